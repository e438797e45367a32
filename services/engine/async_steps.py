"""Async scheduling: launch the next step before the previous step's tokens reach the
host (docs/architecture.md "Async scheduling"). A mixin of LLMEngine, which owns the
scheduler, runner and requests these methods use; one step may be in flight
(engine._in_flight), and step() reads it one call later."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.sampler import DeviceTokens
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class StepInFlight:
    """A step launched on the device whose sampled tokens are not read yet: decode rows
    and, with prompts admitted while a step was in flight, their first tokens."""

    seqs: list[Sequence]
    tokens: DeviceTokens
    # each sequence's sampling request, kept for a next step of the same batch
    sampling: list | None = None
    # id(seq) -> row; given when it is the previous step's (the same batch)
    rows: dict[int, int] | None = None

    def __post_init__(self):
        if self.rows is None:
            self.rows = {id(seq): i for i, seq in enumerate(self.seqs)}


class AsyncSteps:
    # the engine's: scheduler, runner, requests, max_model_len, _async, counters

    def _pipelines(self, items: list[ScheduledSeq]) -> bool:
        """A batch of one new token per sequence, each sampled on the device with
        nothing to report but the token: the next step can start before the host
        sees it."""
        return self._async and all(
            item.num_new_tokens == 1
            and item.completes_prefill
            and self._sampled_on_device(item.seq, 0)
            for item in items
        )

    def _sampled_on_device(self, seq: Sequence, pending: int) -> bool:
        """samples_on_device for seq once `pending` more tokens are out."""
        start = self.requests[seq.seq_id].device_sampling_from
        return start is not None and seq.num_output_tokens + pending >= start

    def _launch(self, seqs: list[Sequence], prev: StepInFlight | None = None) -> StepInFlight:
        # the usual step: the batch in flight again, in its order (compared in C); its
        # sampling requests and rows serve again (a request's sampling request is fixed
        # while it samples on the device: no grammar mask)
        same = prev is not None and prev.sampling is not None and seqs == prev.seqs
        sampling = prev.sampling if same else [self._sampling_request(seq) for seq in seqs]
        if prev is None:
            tokens = self.runner.decode_on_device(seqs, sampling)
        else:
            rows = list(range(len(seqs))) if same else [prev.rows[id(seq)] for seq in seqs]
            tokens = self.runner.decode_on_device(seqs, sampling, prev.tokens.tokens, rows)
        # the token in flight is not known yet: its block joins on reading
        self.scheduler.postprocess_decode(seqs)
        return StepInFlight(seqs, tokens, sampling, prev.rows if same else None)

    def _launch_next(self, done: StepInFlight) -> StepInFlight | None:
        """Launch the step after `done` before reading its tokens, for the sequences
        that go on whatever they are; None if the batch must change first.

        Every sequence of `done` was sampled on the device, and stays so (its
        device_sampling_from is fixed and its output only grows); a running sequence
        that is not in `done` makes the scheduler refuse: so no sequence needs the
        host to sample its next token."""
        max_model_len = self.max_model_len

        def goes_on(seq: Sequence) -> bool:  # False: surely stops on the token in flight
            num_tokens = len(seq.token_ids) + 1
            max_tokens = seq.params.max_tokens
            if max_tokens is not None and num_tokens - len(seq.prompt_token_ids) >= max_tokens:
                return False
            return num_tokens < max_model_len

        if self.scheduler.can_admit():
            return self._launch_mixed(done, goes_on)
        seqs = self.scheduler.schedule_next_decode(done.seqs, goes_on)
        return self._launch(seqs, done) if seqs else None

    def _launch_mixed(self, done: StepInFlight, goes_on) -> StepInFlight | None:
        """Admit waiting prompts next to the decode rows of the step after `done`, still
        without reading its tokens: prompts whose next token is sampled on the device
        and that fit whole (prompt logprobs, structured outputs and chunked prompts go
        through a synchronous step). Tensor-parallel ranks take the synchronous step
        too: they have no copy of the tokens in flight."""
        if self.runner.tp.size > 1:
            return None
        plan = self.scheduler.schedule_next_mixed(
            done.seqs, goes_on, self._admits_pipelined, self.runner.mixed_step_max_tokens
        )
        if plan is None:
            return None
        seqs, admitted = plan
        sampled = seqs + [item.seq for item in admitted]
        sampling = [self._sampling_request(seq) for seq in sampled]
        rows = [done.rows[id(seq)] for seq in seqs]
        tokens = self.runner.mixed_on_device(seqs, admitted, sampling, done.tokens.tokens, rows)
        self.scheduler.postprocess_decode(seqs)
        for item in admitted:
            self.scheduler.postprocess(item.seq, item.num_new_tokens, item.seq.num_tokens)
        self.num_pipelined_mixed_steps += 1
        return StepInFlight(sampled, tokens)

    def _admits_pipelined(self, seq: Sequence) -> bool:
        return not seq.needs_prompt_logprobs and self._sampled_on_device(seq, 0)

    def _read_tokens(self, done: StepInFlight) -> list:
        """The outputs (RequestOutputs, or deltas) of the tokens `done` sampled."""
        outputs = []
        requests, cache_full_blocks = self.requests, self.scheduler.cache_full_blocks
        append_and_check, finished = self._append_and_check, SequenceStatus.FINISHED
        for seq, token in zip(done.seqs, done.tokens.tolist()):
            req = requests.get(seq.seq_id)
            if req is None or req.seq is not seq:
                continue  # aborted while its step ran
            outputs.append(append_and_check(req, token, None))
            if seq.status is not finished:
                cache_full_blocks(seq, len(seq.token_ids))
        return outputs
