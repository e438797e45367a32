"""A request as the engine tracks it: tokens, progress and its KV blocks.

The scheduler and block manager read and update counts here; they never see tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # decode role: blocks reserved, waiting for the prefill worker's KV to arrive
    AWAITING_KV = "awaiting_kv"
    # prefill role: first token sampled, blocks held until the KV is handed over
    PREFILLED = "prefilled"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# eq=False: sequences are compared by identity. A field-by-field __eq__ made `seq in
# scheduler.running` and its remove() build and compare every field of every sequence
# before it: 0.1 ms per finished sequence at 512 running (docs/performance.md)
@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full blocks, in order
    # the chained hashes of its token blocks as far as they were looked up, each made
    # once (token ids only grow): BlockManager.block_hash reads and extends it
    token_block_hashes: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # one per prompt token after the first, collected chunk by chunk
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # monotonic time its blocks became a reservation (AWAITING_KV / PREFILLED)
    reserved_at: float | None = None
    arrival: int | None = None  # the scheduler's arrival order (priority ties)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        # read per sequence per step: len() directly, not through the properties
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs requested and not all collected: every prompt position must
        be computed, so no prefix-cache hits (vLLM recomputes too)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
