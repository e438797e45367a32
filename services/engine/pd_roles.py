"""The prefill and decode roles' entry points (the module doc of llm_engine.py says
what each role does). A mixin of LLMEngine, which owns the scheduler, requests and
output processing these methods use."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.output_deltas import Delta
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence, SequenceStatus


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV blocks right now; retry later."""


@dataclass
class KVReservation:
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens already cached here: their blocks need no KV


class DisaggregatedRoles:
    # the engine's: requests, scheduler, block_manager, tokenize, truncate, validate,
    # _register, _logprob_entry, _append_and_check

    # -- prefill role -------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free a PREFILLED sequence's blocks once its KV has been handed over; full
        blocks stay behind as prefix cache. False if the request is not PREFILLED."""
        req = self.requests.get(request_id)
        if req is None or req.seq.status != SequenceStatus.PREFILLED:
            return False
        del self.requests[request_id]
        self.scheduler.finish(req.seq)
        req.seq.status = SequenceStatus.FINISHED
        return True

    # -- decode role --------------------------------------------------------------------

    def reserve_remote_kv(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> KVReservation:
        """Allocate blocks for a prompt whose KV will be written by a prefill worker.
        Blocks covering the first num_cached_tokens are local prefix-cache hits."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.truncate(self.tokenize(prompt_token_ids), params)
        self.validate(ids, params)
        seq = Sequence(request_id, ids, params)
        if not self.scheduler.reserve(seq):
            bm = self.block_manager
            raise NoFreeBlocksError(
                f"{bm.blocks_needed(seq.num_prompt_tokens)} KV blocks needed, "
                f"{bm.num_free_blocks} free"
            )
        self._register(seq)
        return KVReservation(list(seq.block_table), seq.num_cached_tokens)

    def admit_remote(
        self, request_id: str, first_token: int, first_logprob=None, prompt_logprobs=None
    ) -> RequestOutput | Delta:
        """The KV for the whole prompt is in place: start decoding after first_token.
        first_logprob is (logprob, rank, [(token id, logprob)]) as the sampler makes it;
        prompt_logprobs one such entry per prompt token after the first (computed where
        the prompt was prefilled)."""
        req = self.requests.get(request_id)
        if req is None or req.seq.status != SequenceStatus.AWAITING_KV:
            raise ValueError(f"request {request_id!r} has no KV reservation")
        seq = req.seq
        if seq.params.prompt_logprobs is not None:
            if prompt_logprobs is None or len(prompt_logprobs) != seq.num_prompt_tokens - 1:
                raise ValueError(f"request {request_id!r}: prompt logprobs missing")
            seq.prompt_logprobs = [
                self._logprob_entry(t, lp)
                for t, lp in zip(seq.prompt_token_ids[1:], prompt_logprobs)
            ]
        self.scheduler.admit_remote(seq)
        return self._append_and_check(req, first_token, first_logprob)

    def prefill_locally(self, request_id: str) -> None:
        """The remote prefill failed: compute the prompt here, in the reserved blocks.
        The caller first makes sure no remote write into them can still land."""
        req = self.requests.get(request_id)
        if req is None or req.seq.status != SequenceStatus.AWAITING_KV:
            raise ValueError(f"request {request_id!r} has no KV reservation")
        seq = req.seq
        seq.num_computed_tokens = seq.num_cached_tokens
        self.scheduler.add(seq)
