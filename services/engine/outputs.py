"""What the engine returns per request (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one
    # {token id: Logprob} per prompt token (the token itself plus the top-n), as vLLM
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def output(self) -> CompletionOutput:
        return self.outputs[0]
