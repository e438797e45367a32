"""Continuous batching with chunked prefill, in the style of vLLM v1.

Each step hands out a token budget (max_num_batched_tokens): running sequences first
(a decode costs one token, an unfinished prefill continues with its next chunk), then
waiting sequences in arrival order. When the KV pool runs dry the newest running
sequence is preempted: its blocks are freed and it is recomputed later from its
prompt plus the tokens generated so far. The scheduler only moves counts and block
ids; it never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """After this step every known token has KV, so the next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in place (decode role)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it can run either

        # 2. waiting sequences, unless memory was just short
        while self.waiting and not out.preempted and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if not seq.block_table:
                bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.allocate(seq, seq.num_computed_tokens + num_new):
                bm.free(seq)  # give prefix hits back; retry when memory frees up
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def schedule_next_decode(self, in_flight: list[Sequence], keep) -> list[Sequence] | None:
        """Async scheduling: the decode step after the one in flight, scheduled before
        its sampled tokens reach the host. Runs the running sequences for which
        keep(seq) holds, each with a slot for one more token; None when the batch has
        to change first (a sequence waiting or newly admitted, too many rows, no free
        block), and the caller then finishes the step in flight and calls schedule()."""
        if self.waiting:
            return None
        members = {id(seq) for seq in in_flight}
        if any(id(seq) not in members for seq in self.running):
            return None
        seqs = [seq for seq in self.running if keep(seq)]
        if not seqs or len(seqs) > self.max_num_batched_tokens:
            return None
        for seq in seqs:
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + 1):
                return None  # blocks taken so far serve these sequences' next steps
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
