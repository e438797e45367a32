"""Per-request sampling settings, validated at construction (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# vLLM's structured_outputs keys
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output (vLLM's structured_outputs). kind: json (spec: a
    JSON schema as JSON text; a dict is dumped), json_object (no spec), regex, choice
    (spec: a JSON list of strings; a list is dumped) or grammar (EBNF / GBNF). Only the
    shape is checked here: the engine compiles the spec, refusing one that does not
    compile, when it validates the request. Messages start with "structured output"
    (the router names its field when a worker refuses one)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind in ("json", "choice") and not isinstance(self.spec, str):
            object.__setattr__(self, "spec", json.dumps(self.spec, ensure_ascii=False))
        what = f"structured output ({self.kind})"
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")
        if not isinstance(self.spec, str):
            raise ValueError(f"{what}: the spec must be a string")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError(f"{what} takes no spec")
            return
        if not self.spec:
            raise ValueError(f"{what}: the spec must not be empty")
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"{what}: not valid JSON: {e}") from None
            if self.kind == "json" and not isinstance(value, (dict, bool)):
                raise ValueError(f"{what}: a JSON schema must be an object")
            if self.kind == "choice" and not (
                isinstance(value, list) and value and all(isinstance(c, str) for c in value)
            ):
                raise ValueError(f"{what}: choices must be a non-empty list of strings")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives per token; 0: only the chosen
    skip_special_tokens: bool = True
    # logprobs of each prompt token after the first, with this many top alternatives
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None  # None: every token
    truncate_prompt_tokens: int | None = None  # keep the last N; -1: max_model_len
    structured_output: StructuredOutput | None = None
    # scheduling_policy "priority": lower values are scheduled first (vLLM's rule)
    priority: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        for t, b in self.logit_bias.items():
            if t < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {t}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for {t}")
        self.bad_words = list(self.bad_words or [])
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative token ids")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {t}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_logits_mask(self) -> bool:
        """logit_bias, bad_words or allowed_token_ids shape the logits."""
        return bool(self.logit_bias or self.bad_words) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
