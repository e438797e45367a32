"""The scheduler's host time per step while a prompt with a long cached prefix waits for
KV blocks (the pool is held by running sequences): a multi-turn conversation arriving
at a server whose memory is full. Every step looks the waiting prompt up in the prefix
cache again; this times schedule() per call. No model, no GPU.

    .venv/bin/python benchmarks/scheduler_cost.py [--cached-tokens 16384] [--new-tokens 16384]
"""

from __future__ import annotations

import argparse
import time

from services.engine import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached-tokens", type=int, default=16384, help="the earlier turns")
    ap.add_argument("--new-tokens", type=int, default=16384, help="the new turn")
    ap.add_argument("--running", type=int, default=32, help="sequences holding the pool")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    bs = 16
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    history = list(range(5, 5 + args.cached_tokens))
    # room for the history, the running sequences and a little more: not for the prompt
    num_blocks = (args.cached_tokens + args.running * 1000) // bs + args.running + 60
    bm = BlockManager(num_blocks=num_blocks, block_size=bs)
    sched = Scheduler(bm, max_num_seqs=args.running + 8, max_num_batched_tokens=1 << 22)

    def prefill(seqs):
        for seq in seqs:
            sched.add(seq)
        while sched.waiting:
            for s in sched.schedule().scheduled:
                sched.postprocess(s.seq, s.num_new_tokens, s.seq.num_tokens)

    earlier = Sequence("turn-1", history, params)
    prefill([earlier])
    sched.finish(earlier)  # its blocks stay in the prefix cache
    base = 1 << 24
    prefill(
        [
            Sequence(f"run-{i}", list(range(base + i * 1000, base + (i + 1) * 1000)), params)
            for i in range(args.running)
        ]
    )
    new_turn = list(range(7, 7 + args.new_tokens))
    sched.add(Sequence("turn-2", history + new_turn, params))
    start = time.perf_counter()
    for _ in range(args.calls):
        out = sched.schedule()
    per_call = (time.perf_counter() - start) / args.calls
    assert sched.waiting and not out.preempted, "the prompt was admitted: the pool is too big"
    print(
        f"schedule() with a {len(history) + len(new_turn)}-token prompt waiting "
        f"({len(history)} tokens cached, {bm.num_free_blocks} blocks free): "
        f"{per_call * 1e3:.2f} ms per call"
    )


if __name__ == "__main__":
    main()
