"""What a request is checked against before the engine takes it: the prompt's tokens
(tokenized here, range-checked, truncated as asked) and its sampling parameters against
the model (vocabulary, context length, scheduling policy, a structured output's grammar).

Needs the tokenizer and the model's config, not its weights: the engine checks each
request it adds with one, and a worker whose engine runs in another process
(engine_core.py) checks requests with its own before they cross over."""

from __future__ import annotations

from services.engine.sampling_params import SamplingParams
from services.engine.structured import Grammars


class RequestChecks:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        grammars: Grammars,
        scheduling_policy: str,
        max_model_len: int,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len  # the engine's, once its KV cache is sized

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")
        return ids

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The last truncate_prompt_tokens prompt tokens (-1: the last max_model_len)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        keep = self.max_model_len if keep == -1 else keep
        return prompt_token_ids[-keep:]

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, *, fit_max_tokens: bool = False
    ) -> None:
        """Raises ValueError for a request this engine cannot run. fit_max_tokens: also
        refuse a prompt + max_tokens beyond max_model_len (the servers do, as vLLM's
        OpenAI server; offline generation stops at max_model_len instead)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if params.priority != 0 and self.scheduling_policy != "priority":
            # vLLM's answer under its default policy: a priority would be a promise not kept
            raise ValueError(
                "priority scheduling is not enabled: this worker schedules first come, "
                "first served (--scheduling-policy fcfs); 'priority' must be 0"
            )
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside [0, {vocab}): {bad[:5]}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none")
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # cached; ValueError if bad
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; max_model_len is {self.max_model_len} "
                "(a prompt must leave room for at least one generated token)"
            )
        if fit_max_tokens and params.max_tokens is not None:
            if n + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the prompt has {n} and max_tokens is {params.max_tokens}"
                )

    def decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
