"""What the engine returns per request (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.sequence import Logprob


class CompletionOutput:
    """One completion (vLLM's shape): the output so far, its text, logprobs and, once
    finished, why. The engine builds one per running request per step from the
    sequence's own token list (`source`, from `start` on) and slices it only when
    `token_ids` is read: the first `end` entries never change, since that list only
    grows, so a stream that reads only the new tokens (`token_ids_from`) costs O(new
    tokens) per step rather than a copy of the whole output, which made long outputs
    quadratic (10 us a step per request at 8k tokens on a 2-core CPU)."""

    __slots__ = (
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "_token_ids",
        "_source",
        "_start",
        "_end",
    )

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int] | None = None,
        logprobs: list[dict[int, Logprob]] | None = None,
        finish_reason: str | None = None,  # "stop", "length", "abort"
        stop_reason: int | str | None = None,  # the stop token id or string that matched
        *,
        source: list[int] | None = None,  # instead of token_ids: source[start:] as of now
        start: int = 0,
    ):
        if (token_ids is None) == (source is None):
            raise ValueError("CompletionOutput takes token_ids or source, exactly one")
        self.index, self.text, self.logprobs = index, text, logprobs
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self._token_ids = token_ids
        self._source = source if source is not None else token_ids
        self._start = start if source is not None else 0
        self._end = len(self._source)

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._token_ids = self._source[self._start : self._end]
        return self._token_ids

    @property
    def num_token_ids(self) -> int:
        return self._end - self._start

    def token_ids_from(self, i: int) -> list[int]:
        """token_ids[i:] without building token_ids."""
        return self._source[self._start + i : self._end]

    def _fields(self) -> tuple:
        return (
            self.index,
            self.text,
            self.token_ids,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # mutable, like the dataclass it replaced

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


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
