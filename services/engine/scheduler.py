"""Continuous batching with chunked prefill, in the style of vLLM v1.

Each step hands out a token budget (max_num_batched_tokens): running sequences first
(a decode costs one token, an unfinished prefill continues with its next chunk), then
waiting sequences in arrival order. When the KV pool runs dry the newest running
sequence is preempted: its blocks are freed and it is recomputed later from its
prompt plus the tokens generated so far. The scheduler only moves counts and block
ids; it never touches tensors.
"""

from __future__ import annotations

import bisect
import itertools
import time
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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # "priority": the waiting queue in (priority, arrival) order, and memory taken
        # from the running sequence last in that order (vLLM's policy)
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.arrival is None:
            seq.arrival = next(self._arrivals)
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        if not self.by_priority:
            if front:  # a preempted sequence goes first again
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        keys = [_order(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _order(seq)), seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in place (decode role)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """A sequence waits and the batch has a seat for it (max_num_seqs): at the
        limit the running batch goes on as it is while the queue waits."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

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
                victim = self._victim()
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
        to change first (a sequence that could be admitted, one newly admitted, too many
        rows, no free block), and the caller then finishes the step in flight and calls
        schedule()."""
        if self.can_admit():
            return None
        seqs = self._next_decode_rows(in_flight, keep, self.max_num_batched_tokens)
        return seqs or None

    def schedule_next_mixed(
        self, in_flight: list[Sequence], keep, admit, max_tokens: int
    ) -> tuple[list[Sequence], list[ScheduledSeq]] | None:
        """Async scheduling with sequences waiting: the running sequences as in
        schedule_next_decode, plus waiting ones, in order while admit(seq) holds, whose
        whole remaining prompt fits in what max_tokens leaves (a chunked prompt goes
        through schedule()). None when nothing can be admitted this way: the caller
        then finishes the step in flight and calls schedule()."""
        limit = min(max_tokens, self.max_num_batched_tokens)
        seqs = self._next_decode_rows(in_flight, keep, limit - 1)
        if seqs is None:
            return None
        budget = limit - len(seqs)
        bm = self.block_manager
        admitted: list[ScheduledSeq] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not admit(seq):
                break
            if not seq.block_table:
                bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget or not bm.allocate(seq, seq.num_tokens):
                bm.free(seq)  # prefix hits go back; schedule() takes it later
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return (seqs, admitted) if admitted else None

    def _next_decode_rows(self, in_flight: list[Sequence], keep, max_rows: int):
        """The running sequences for which keep(seq) holds, each given a slot for one
        more token (possibly none of them); None unless the batch is exactly the one in
        flight (no sequence joined since), there are at most max_rows of them and every
        slot was found."""
        # the usual case, the same batch in the same order, compares in C (identity)
        if self.running != in_flight:
            members = {id(seq) for seq in in_flight}
            if any(id(seq) not in members for seq in self.running):
                return None
        seqs = [seq for seq in self.running if keep(seq)]
        if len(seqs) > max_rows:
            return None
        bs, allocate = self.block_manager.block_size, self.block_manager.allocate
        for seq in seqs:
            if seq.num_computed_tokens < len(seq.block_table) * bs:
                continue  # its last block has room (the usual case: no call)
            if not allocate(seq, seq.num_computed_tokens + 1):
                return None  # blocks taken so far serve these sequences' next steps
        return seqs

    # -- after a step: the scheduler owns every count and block (nano-vllm's postprocess)

    def postprocess(self, seq: Sequence, num_new_tokens: int, num_known_tokens: int) -> None:
        """seq's KV now covers num_new_tokens more positions; full blocks of its first
        num_known_tokens tokens join the prefix cache."""
        seq.num_computed_tokens += num_new_tokens
        self.cache_full_blocks(seq, num_known_tokens)

    def postprocess_decode(self, seqs: list[Sequence]) -> None:
        """postprocess(seq, 1, seq.num_tokens) for each of a launched decode step's
        sequences (its tokens are not known yet), in one loop: hundreds per step."""
        cache_full_blocks = self.cache_full_blocks
        for seq in seqs:
            seq.num_computed_tokens += 1
            cache_full_blocks(seq, len(seq.token_ids))

    def cache_full_blocks(self, seq: Sequence, num_known_tokens: int) -> None:
        """Full blocks whose KV is written and whose tokens are all known (a token still
        being sampled on the device is not) join the prefix cache."""
        num_full_tokens = min(seq.num_computed_tokens, num_known_tokens)
        # called per sequence per step: a call only once a block has filled since
        if num_full_tokens >= (len(seq.block_hashes) + 1) * self.block_manager.block_size:
            self.block_manager.cache_full_blocks(seq, num_full_tokens)

    def finish(self, seq: Sequence) -> None:
        """seq leaves the batch and its blocks go back (full ones stay as prefix cache).
        The caller makes sure no device work still writes them."""
        self.remove(seq)
        self.block_manager.free(seq)

    def reserve(self, seq: Sequence) -> bool:
        """Decode role: blocks for a whole prompt that a prefill worker will fill (local
        prefix-cache hits included). False, with nothing held, when too few are free."""
        bm = self.block_manager
        bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
        if not bm.allocate(seq, seq.num_prompt_tokens):
            bm.free(seq)
            return False
        seq.status = SequenceStatus.AWAITING_KV
        seq.reserved_at = time.monotonic()
        return True

    def admit_remote(self, seq: Sequence) -> None:
        """Decode role: the prompt's KV has arrived; decode from the next token on."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.cache_full_blocks(seq, seq.num_computed_tokens)
        self.add_running(seq)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "prefix_cache_hit_blocks": bm.prefix_hits,
            "prefix_cache_queried_blocks": bm.prefix_queries,
        }

    def _victim(self) -> Sequence:
        """The running sequence that gives its memory back: the newest, or by priority
        the last in (priority, arrival) order."""
        if not self.by_priority:
            return self.running.pop()
        victim = max(self.running, key=_order)
        self.running.remove(victim)
        return victim

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.params.priority, seq.arrival if seq.arrival is not None else 0
