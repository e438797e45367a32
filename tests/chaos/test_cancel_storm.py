"""Scenario d: many streamed requests, each abandoned by its client at a random moment
(a seeded RNG): while queued, in the prefill worker (before or after computing the
prompt), in the KV transfer, or while decoding. Most are abandoned after a random
delay; 5% once their first 1-4 chunks of text have arrived (decoding, whatever the
machine's speed); 10% are let finish. The client cancels by hanging up (the official
openai client's request task is cancelled, which closes the HTTP response).
Afterwards neither worker holds a KV block or an orphaned one, the requests that were
let finish equal the colocated engine's answers, and a normal request is still answered
right.

The prefill worker's windows are widened with faults so that each phase is hit often:
each Prefill waits 0.1 s before computing and 0.2 s between computing and writing
(PDSERVE_FAULT_STALL_BEFORE/AFTER_PREFILL_S), and every KV write starts 10 ms late
(PDSERVE_FAULT_WRITE_DELAY_S: a cancellation can land while the write is inside the
transfer engine and cannot be called back).

The issue asks for 1,000 requests. COUNT is what keeps this test near a minute on the
2-core CI machine (docs/reliability.md has the measurements); CHAOS_CANCEL_COUNT
overrides it (e.g. 1000 on a bigger machine)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

from tests.chaos.stack import (
    Outcome,
    Stack,
    assert_blocks_back,
    client,
    count_log,
    note,
    prompts,
    references,
    run_streams,
    stream_completion,
)

COUNT = int(os.environ.get("CHAOS_CANCEL_COUNT", "1000"))
CONCURRENCY = 48
MAX_TOKENS = 8
FINISH_SHARE = 0.1  # requests let finish (checked against the references)
CHUNKS_SHARE = 0.05  # requests abandoned after their first 1-4 chunks of text
SEED = 18
LOG_DELAYS = (math.log(0.005), math.log(6.0))  # abandon after 5 ms to 6 s
STALL_S = 0.1
FAULTS = {
    "PDSERVE_FAULT_STALL_BEFORE_PREFILL_S": str(STALL_S),
    "PDSERVE_FAULT_STALL_AFTER_PREFILL_S": str(2 * STALL_S),
    "PDSERVE_FAULT_WRITE_DELAY_S": "0.01",
}


async def _storm(url: str, texts: list[str], plan: list[tuple]):
    """Every request streamed (CONCURRENCY at a time), request i ended as plan[i] says:
    ("finish",) let it finish; ("after", s) hang up after s seconds; ("chunks", k) hang
    up once k chunks of text have arrived (decoding, however slow the machine).
    Returns the outcomes."""
    outs = [Outcome() for _ in texts]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(c, i):
        how = plan[i]
        async with gate:
            reached = asyncio.Event()

            def on_chunk(out):
                if how[0] == "chunks" and out.chunks >= how[1]:
                    reached.set()

            task = asyncio.ensure_future(
                stream_completion(c, texts[i], MAX_TOKENS, outs[i], on_chunk=on_chunk)
            )
            if how[0] == "finish":
                await asyncio.wait_for(task, 120)
                return
            if how[0] == "after":
                await asyncio.wait([task], timeout=how[1])
            else:
                waiter = asyncio.ensure_future(reached.wait())
                await asyncio.wait([task, waiter], timeout=120, return_when="FIRST_COMPLETED")
                waiter.cancel()
            if not task.done():
                task.cancel()  # hang up: the HTTP response is closed
            await asyncio.gather(task, return_exceptions=True)

    async with client(url, timeout=120) as c:
        await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(len(texts)))), 600)
    return outs


def _plan(rng: random.Random) -> tuple:
    x = rng.random()
    if x < FINISH_SHARE:
        return ("finish",)
    if x < FINISH_SHARE + CHUNKS_SHARE:
        return ("chunks", rng.randint(1, MAX_TOKENS // 2))
    # Abandon times cover a request's life under this load (queueing behind the other
    # requests, the two stalls, prefill, transfer, 8 decode steps: 2-8 s on 2 cores),
    # log-uniform so that the short early phases are hit as often as the long ones
    return ("after", math.exp(rng.uniform(*LOG_DELAYS)))


def test_random_cancellations_leave_nothing_behind(model, colocated):
    rng = random.Random(SEED)
    # 64 prompts, each sent ~16 times: half are short, half ~40 tokens, whose first two
    # KV blocks are shared through the prefix caches of both workers by their repeats
    # (a cancellation must drop its references to shared blocks, not the blocks)
    base = prompts(32, "d") + prompts(32, "dl", repeat=3)
    base_refs = references(colocated, base, MAX_TOKENS)
    picks = [rng.randrange(len(base)) for _ in range(COUNT)]
    texts = [base[k] for k in picks]
    refs = [base_refs[k] for k in picks]
    plan = [_plan(rng) for _ in texts]
    finishing = [i for i, how in enumerate(plan) if how[0] == "finish"]
    normal = prompts(1, "dn")
    normal_ref = references(colocated, normal, 16)

    with Stack(model, prefill=[{"env": FAULTS}]) as stack:
        (prefill,) = stack.prefills
        started = time.monotonic()
        outs = asyncio.run(_storm(stack.router.url, texts, plan))
        took = time.monotonic() - started

        kinds = {k: sum(o.kind == k for o in outs) for k in {o.kind for o in outs}}
        cancelled = [o for o in outs if o.kind == "cancelled"]
        in_decode = sum(o.chunks > 0 for o in cancelled)
        timed = [o for o, how in zip(outs, plan) if how[0] == "after" and o.kind == "cancelled"]
        timed_in_decode = sum(o.chunks > 0 for o in timed)
        # where the cancellations landed, from the prefill worker's side
        reached_prefill = count_log(prefill, "before prefill")
        computed = count_log(prefill, "after prefill")
        p = prefill.load()
        written = p.kv_transfers_ok + p.kv_transfers_failed
        done = sorted(outs[i].elapsed_s for i in finishing)
        ttft = sorted(outs[i].first_token_s or 0 for i in finishing)
        note(
            f"finished: ttft p50 {ttft[len(ttft) // 2]:.2f}s e2e p50 {done[len(done) // 2]:.2f}s max {done[-1]:.2f}s"
        )
        note(
            f"{COUNT} requests in {took:.1f}s: outcomes {kinds}; cancelled: "
            f"{len(cancelled)} ({in_decode} while decoding, {timed_in_decode} of them at a "
            f"random time); prefill worker: "
            f"{reached_prefill} reached it, {computed} computed, {written} written"
        )
        # the requests let finish finished, every finished one is right, the others'
        # text so far is right too; nothing failed
        assert all(outs[i].kind == "ok" for i in finishing), [outs[i].detail for i in finishing]
        for o, ref in zip(outs, refs):
            assert o.text == ref if o.kind == "ok" else ref.startswith(o.text), (o.text, ref)
        assert not [o for o in outs if o.kind not in ("ok", "cancelled")], [
            o.detail for o in outs if o.kind not in ("ok", "cancelled")
        ]
        # every phase was hit: before reaching the prefill worker (queued), in its
        # stall before computing, between computing and the end of the write, decoding
        assert len(cancelled) > COUNT // 2
        assert reached_prefill < COUNT, "no request was cancelled while queued"
        assert computed < reached_prefill, "none was cancelled before its prefill ran"
        assert written < computed, "none was cancelled between its prefill and its write"
        assert 0 < in_decode < len(cancelled), "none was cancelled while decoding"

        assert_blocks_back(stack.workers)
        got = asyncio.run(run_streams(stack.router.url, normal, 16))
        assert [o.text for o in got] == normal_ref, [o.detail for o in got]
        assert_blocks_back(stack.workers)
