"""Leak accounting: KV blocks held that no known request explains, and the age of the
oldest reservation, exported by every worker so a leak shows on a dashboard long
before the pool runs dry.

A block's reference count is the number of sequences whose block tables hold it. The
engine knows its sequences (its requests, and the step in flight); any reference
beyond theirs is held by something the engine forgot: an orphan. Reservations are
blocks held for a transfer: a decode worker's AWAITING_KV sequences (the prefill worker
writes them) and a prefill worker's PREFILLED ones (their KV is being sent); one that
stays old means a peer that never finished. Call on the engine's thread."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from services.engine.sequence import SequenceStatus

_RESERVED = (SequenceStatus.AWAITING_KV, SequenceStatus.PREFILLED)


@dataclass(frozen=True)
class KVAudit:
    orphaned_blocks: int  # references no known sequence holds (must stay 0)
    oldest_reservation_s: float  # 0.0 when nothing is reserved

    def as_dict(self) -> dict:
        return {
            "orphaned_kv_blocks": self.orphaned_blocks,
            "oldest_kv_reservation_seconds": self.oldest_reservation_s,
        }


def audit_kv(engine, now: float | None = None) -> KVAudit:
    now = time.monotonic() if now is None else now
    seqs = {id(r.seq): r.seq for r in engine.requests.values()}
    for seq in (*engine.scheduler.running, *engine.scheduler.waiting):
        seqs.setdefault(id(seq), seq)
    expected: Counter[int] = Counter()
    oldest = 0.0
    for seq in seqs.values():
        expected.update(seq.block_table)
        if seq.status in _RESERVED and seq.reserved_at is not None:
            oldest = max(oldest, now - seq.reserved_at)
    # Blocks no known sequence holds count whole; walking only the known ones keeps the
    # audit proportional to the blocks in use, not to the pool.
    bm = engine.block_manager
    held = sum(bm.blocks[b].ref_count for b in expected)
    orphaned = bm.total_refs - held
    orphaned += sum(max(0, bm.blocks[b].ref_count - n) for b, n in expected.items())
    return KVAudit(orphaned, round(oldest, 3))
