"""Scenario c: a decode worker is killed (SIGKILL) with 16 streams in flight, two
decode workers behind the router. Streams that had started on it end with a clean SSE
error event (OpenAI's error object, then the stream closes: no hang); requests that had
not produced a token yet (held in the prefill worker by PDSERVE_FAULT_STALL_BEFORE_PREFILL_S)
are retried on the other decode worker and answered right; the router's /ready tells
the truth within 3 s; the survivors end with every KV block free and none orphaned."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from tests.chaos.stack import (
    Stack,
    assert_blocks_back,
    assert_openai_error,
    note,
    prompts,
    references,
    run_streams,
    run_streams_with,
    until,
)

STARTED = 16  # streams producing tokens when the worker dies
WAITING = 8  # requests sent just before, still held in the prefill stall
LONG, SHORT = 96, 12  # max_tokens of each group
STALL_S = 1.5
STALLED = "fault injection: stalling request"


def test_decode_worker_killed_with_16_streams(model, colocated):
    started = prompts(STARTED, "cs")
    started_refs = references(colocated, started, LONG)
    waiting = prompts(WAITING, "cw")
    waiting_refs = references(colocated, waiting, SHORT)
    after = prompts(8, "ca")
    after_refs = references(colocated, after, SHORT)
    stack = Stack(
        model,
        prefill=[{"env": {"PDSERVE_FAULT_STALL_BEFORE_PREFILL_S": str(STALL_S)}}],
        decode=[{}, {}],
        router_args=("--decode-policy", "round_robin"),
    )
    with stack:
        (prefill,) = stack.prefills
        victim, survivor = stack.decodes
        router = stack.router
        result = {}

        async def kill_with_streams_in_flight(outs):
            # every one of the 16 streams has produced a token
            await until(lambda: all(o.chunks for o in outs), 120, "16 started streams")
            victim_load = await asyncio.to_thread(victim.load)
            assert victim_load.num_running + victim_load.num_waiting > 0, victim_load
            # the prefill worker's stall lines name each request's decode worker
            (key_line,) = [line for line in victim.log if "request keys end in @" in line]
            tag = "@" + key_line.split("@")[1].split(".")[0] + "."

            def stalled_on_victim() -> int:
                return sum(STALLED in line and tag in line for line in list(prefill.log))

            on_victim = stalled_on_victim()
            # then 8 more requests, held before their prefill: no token yet
            async with asyncio.timeout(120):
                waiting_task = asyncio.ensure_future(run_streams(router.url, waiting, SHORT))
                # round robin sends half of them to the victim: kill it as soon as its
                # half is stalled (the other half may reach the prefill worker seconds
                # later on a loaded machine; the victim's would be out of the stall)
                await until(
                    lambda: stalled_on_victim() >= on_victim + WAITING // 2,
                    60,
                    "the victim's 4 stalls",
                )
                os.kill(victim.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                note("decode worker killed with streams in flight")
                # /ready is truthful within 3 s: one decode worker, one pair
                deadline = killed_at + 3.0
                while True:
                    status, body = await asyncio.to_thread(router.ready)
                    if status == 200 and body["healthy_decode"] == 1 and body["pairs"] == 1:
                        break
                    assert time.monotonic() < deadline, (status, body)
                    await asyncio.sleep(0.05)
                result["ready_after_s"] = time.monotonic() - killed_at
                result["waiting"] = await waiting_task

        outcomes = asyncio.run(
            run_streams_with(router.url, started, LONG, kill_with_streams_in_flight)
        )
        note("ready truthful after", f"{result['ready_after_s']:.2f}s")
        errored = [o for o in outcomes if o.kind != "ok"]
        if errored:
            note(
                f"{len(errored)} of {STARTED} streams ended by an error event, e.g.",
                errored[0].error,
            )
        # the started streams: finished right on the survivor, or ended by an error event
        assert 0 < len(errored) < STARTED, [o.kind for o in outcomes]
        for o, ref in zip(outcomes, started_refs):
            if o.kind == "ok":
                assert o.text == ref
            else:
                assert o.kind == "sse_error", (o.kind, o.detail)
                assert_openai_error(o.error)
                assert o.chunks > 0 and ref.startswith(o.text), (o.text, ref)
        # the not-yet-started requests: every one answered right (retried if it was on
        # the dead worker)
        got = result["waiting"]
        assert [o.kind for o in got] == ["ok"] * WAITING, [o.detail for o in got]
        assert [o.text for o in got] == waiting_refs
        assert router.metric('pdserve_router_retries_total{code="UNAVAILABLE"}') >= 1
        assert router.metric("pdserve_router_stream_errors_total") == len(errored)
        # the stack still serves, on the survivor
        got = asyncio.run(run_streams(router.url, after, SHORT))
        assert [o.text for o in got] == after_refs, [o.detail for o in got]
        assert_blocks_back([prefill, survivor])
