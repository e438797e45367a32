"""Scenario e: the router process dies (SIGKILL) with streams in flight and a new one
is started on the same port with the same workers: the clients of the dead router see
their connections end (no hang), the workers abort those requests and free their
blocks, and every request through the new router is answered right.

The prefill worker also refuses its first two handshakes
(PDSERVE_FAULT_FAIL_HANDSHAKES=2): the first router reports not ready (/ready 503)
until the pairing succeeds on a later round, then serves normally."""

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
LONG, SHORT = 48, 12
REFUSED = 2


def test_router_restart_with_streams_in_flight(model, colocated):
    texts = prompts(STREAMS, "e")
    refs = references(colocated, texts, LONG)
    after = prompts(STREAMS, "e2")
    after_refs = references(colocated, after, SHORT)
    stack = Stack(
        model, prefill=[{"env": {"PDSERVE_FAULT_FAIL_HANDSHAKES": str(REFUSED)}}], decode=[{}]
    )
    with stack:  # waits until the router has a usable pair
        (prefill,) = stack.prefills
        first = stack.router
        # the refused handshakes: logged by the worker, retried by the router, and the
        # router was not ready meanwhile
        assert (
            count_log(prefill, "WARNING kvtransfer.faults: fault injection: failing handshake")
            == REFUSED
        )
        assert count_log(first, "pairing decode") == REFUSED, "".join(first.log)
        assert count_log(first, "paired with prefill worker") == 1
        # one router process: its startup heap frozen out of the collector (pdpb/heap.py)
        assert count_log(first, "startup objects frozen out of GC") == 1, "".join(first.log)
        unpaired = {"ready": False, "healthy_prefill": 1, "healthy_decode": 1, "pairs": 0}
        assert (503, unpaired) in first.ready_seen, first.ready_seen

        async def kill_router(outs):
            await until(lambda: all(o.chunks for o in outs), 120, "every stream started")
            os.kill(first.proc.pid, signal.SIGKILL)
            note("router killed with streams in flight")
            assert await asyncio.to_thread(first.proc.wait, 10) == -signal.SIGKILL

        started = time.monotonic()
        outs = asyncio.run(run_streams_with(first.url, texts, LONG, kill_router))
        # the clients learn at once that the connection is gone
        assert [o.kind for o in outs] == ["connection"] * STREAMS, [o.detail for o in outs]
        assert time.monotonic() - started < 60
        for o, ref in zip(outs, refs):  # what arrived before the router died was right
            assert 0 < len(o.text) < len(ref) and ref.startswith(o.text), (o.text, ref)
        # the workers noticed the router's streams break: every request aborted, freed
        assert_blocks_back(stack.workers)

        second = stack.start_router(port=first.port)
        second.wait_ready(pairs=1, timeout=30)
        got = asyncio.run(run_streams(second.url, after, SHORT))
        assert [o.kind for o in got] == ["ok"] * STREAMS, [o.detail for o in got]
        assert [o.text for o in got] == after_refs
        assert_blocks_back(stack.workers)
        assert count_log(prefill, "failing handshake") == REFUSED  # no more since
