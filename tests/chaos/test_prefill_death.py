"""Scenario b: a prefill worker dies (SIGKILL) in the middle of KV transfers, and a
prefill worker freezes (SIGSTOP) for longer than the decode worker's deadline, then
wakes (SIGCONT), both under concurrent streaming load through the router with a second,
healthy prefill worker. Every answer equals the colocated engine's (the decode worker
recomputes what the frozen or dead worker did not deliver), the router stops using the
sick worker, and every live worker ends with all its KV blocks free and none orphaned.

The moments are made deterministic with faults. The worker to kill starts each write
late (PDSERVE_FAULT_WRITE_DELAY_S), writes half of a request's blocks and then pauses
(PDSERVE_FAULT_PAUSE_MID_TRANSFER_S): it dies mid-transfer, the decode worker holding
half-written blocks and more writes queued. The worker to freeze holds each request
0.3 s before its prefill (PDSERVE_FAULT_STALL_BEFORE_PREFILL_S): it is frozen with
requests in flight, their blocks reserved on the decode side, however fast the machine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from tests.chaos.stack import (
    Stack,
    assert_blocks_back,
    count_log,
    note,
    prompts,
    references,
    run_streams,
    run_streams_with,
    until,
)

STREAMS = 8
MAX_TOKENS = 12
REPEAT = 4  # ~50-token prompts: 4 blocks, so a transfer has two halves


def _check(outcomes, refs):
    assert [o.kind for o in outcomes] == ["ok"] * len(refs), [o.detail for o in outcomes]
    assert [o.text for o in outcomes] == refs


def test_prefill_worker_killed_mid_transfer(model, colocated):
    texts = prompts(STREAMS, "bk", repeat=REPEAT)
    refs = references(colocated, texts, MAX_TOKENS)
    after = prompts(STREAMS, "bk2", repeat=REPEAT)
    after_refs = references(colocated, after, MAX_TOKENS)
    sick_env = {"PDSERVE_FAULT_WRITE_DELAY_S": "0.5", "PDSERVE_FAULT_PAUSE_MID_TRANSFER_S": "60"}
    stack = Stack(
        model,
        prefill=[{"env": sick_env}, {}],
        decode=[{"args": ("--prefill-timeout", "30")}],
        router_args=("--prefill-policy", "round_robin"),
    )
    with stack:
        sick, healthy = stack.prefills
        (decode,) = stack.decodes

        async def kill_mid_transfer(outs):
            # half of a request's blocks have landed in the decode worker, the rest
            # never will: the transfer is under way
            await until(lambda: count_log(sick, "pausing") >= 1, 60, "a paused transfer")
            os.kill(sick.proc.pid, signal.SIGKILL)
            note("prefill worker killed mid-transfer")
            assert sick.proc.wait(10) == -signal.SIGKILL

        outcomes = asyncio.run(
            run_streams_with(stack.router.url, texts, MAX_TOKENS, kill_mid_transfer)
        )
        _check(outcomes, refs)
        # the requests the dead worker held were prefilled again by the decode worker
        assert decode.load().prefill_fallbacks >= 1
        assert count_log(sick, "delaying a write") >= 1
        stack.router.wait_ready(pairs=1, timeout=10)  # the dead worker is out
        _check(asyncio.run(run_streams(stack.router.url, after, MAX_TOKENS)), after_refs)
        assert_blocks_back([healthy, decode])


def test_prefill_worker_stopped_past_the_deadline(model, colocated):
    texts = prompts(STREAMS, "bs", repeat=REPEAT)
    refs = references(colocated, texts, MAX_TOKENS)
    after = prompts(STREAMS, "bs2", repeat=REPEAT)
    after_refs = references(colocated, after, MAX_TOKENS)
    deadline_s, stop_s = 3.0, 6.0
    stack = Stack(
        model,
        # requests on the worker to freeze wait 0.3 s before their prefill: it is
        # frozen with requests in flight whatever the machine's speed
        prefill=[{"env": {"PDSERVE_FAULT_STALL_BEFORE_PREFILL_S": "0.3"}}, {}],
        decode=[{"args": ("--prefill-timeout", str(deadline_s))}],
        router_args=("--prefill-policy", "round_robin"),
    )
    with stack:
        frozen, healthy = stack.prefills
        (decode,) = stack.decodes

        async def stop_then_continue(outs):
            await until(lambda: count_log(frozen, "before prefill") >= 1, 60, "a request")
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            note("prefill worker stopped")
            try:
                # past the decode worker's deadline its requests fall back (the abort
                # they then send waits for the frozen worker)...
                await until(lambda: decode.load().prefill_fallbacks >= 1, 60, "a fallback")
                note(f"decode worker fell back after {time.monotonic() - stopped_at:.1f}s")
                # ... and the router stops pairing with the frozen worker (its probes
                # time out), while the other pair serves
                await until(lambda: stack.router.pairs() == 1, 60, "the frozen worker unpaired")
                note(f"router unpaired it after {time.monotonic() - stopped_at:.1f}s")
                assert frozen.proc.poll() is None
                # frozen for longer than the decode worker's deadline, then woken
                await asyncio.sleep(max(0.0, stopped_at + stop_s - time.monotonic()))
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)
                note(f"prefill worker continued after {time.monotonic() - stopped_at:.1f}s")

        outcomes = asyncio.run(
            run_streams_with(stack.router.url, texts, MAX_TOKENS, stop_then_continue)
        )
        _check(outcomes, refs)
        assert decode.load().prefill_fallbacks >= 1
        # the woken worker is healthy and paired again, and everything works
        stack.router.wait_ready(pairs=2, timeout=30)
        _check(asyncio.run(run_streams(stack.router.url, after, MAX_TOKENS)), after_refs)
        assert_blocks_back(stack.workers)
