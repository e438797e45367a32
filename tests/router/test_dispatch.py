"""Dispatcher behaviour that needs no worker: no pair -> one 503 per choice, unique
worker-side request ids, and DNS targets followed as they change."""

from __future__ import annotations

import asyncio
import logging

from router import registry as registry_module
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.metrics import RouterMetrics
from router.protocol import parse_completion_request
from router.registry import WorkerRegistry
from router.request_id import RequestLog


def make(**kw):
    cfg = RouterConfig(host="127.0.0.1", port=0, **kw)
    reg = WorkerRegistry(cfg)
    return reg, Dispatcher(reg, RouterMetrics())


def test_no_pair_gives_503_per_choice_and_unique_ids():
    async def main():
        reg, disp = make()
        req = parse_completion_request({"prompt": ["a", "b"], "n": 2})
        log = RequestLog(logging.getLogger("t"), "rid")
        async with disp.run(req, "rid", log, None) as run:
            assert disp._active == {"rid"}
            # a second request reusing the client's X-Request-Id gets other worker ids
            async with disp.run(req, "rid", log, None) as again:
                assert again.base_id != "rid" and again.base_id.startswith("rid.")
                assert again._worker_id(3, 1) == f"{again.base_id}-3-r1"
            events = [ev async for ev in run.events()]
        assert sorted(ev.index for ev in events) == [0, 1, 2, 3]
        assert all(ev.error.status == 503 for ev in events)
        assert disp._active == set()
        assert run._worker_id(0, 0) == "rid-0"

    asyncio.run(main())


def test_dns_targets_are_followed(monkeypatch):
    answers = {"svc.test:50051": {"10.0.0.1:50051", "10.0.0.2:50051"}}

    async def fake_resolve(address):
        return set(answers[address])

    monkeypatch.setattr(registry_module, "resolve", fake_resolve)

    async def main():
        reg, _ = make(
            decode=("svc.test:50051",), dns_interval=0.05, health_interval=0.05, health_timeout=0.2
        )
        await reg.start()
        try:
            for _ in range(100):
                if len(reg.workers) == 2:
                    break
                await asyncio.sleep(0.02)
            assert {w.address for w in reg.of_role("decode")} == answers["svc.test:50051"]
            answers["svc.test:50051"] = {"10.0.0.2:50051", "10.0.0.3:50051"}  # a pod replaced
            for _ in range(100):
                if {w.address for w in reg.of_role("decode")} == answers["svc.test:50051"]:
                    break
                await asyncio.sleep(0.02)
            assert {w.address for w in reg.of_role("decode")} == answers["svc.test:50051"]
        finally:
            await reg.close()

    asyncio.run(main())


def _run_events(disp, req):
    async def main():
        log = RequestLog(logging.getLogger("t"), "rid")
        async with disp.run(req, "rid", log, None) as run:
            return [ev async for ev in run.events()]

    return asyncio.run(asyncio.wait_for(main(), 10))  # a hang fails here instead


def test_an_exception_in_a_choice_ends_it_with_an_error(monkeypatch):
    """Injected faults: a value the worker request refuses (400) and a router bug (500)
    end their choice with an error event; the request never waits for it forever."""
    from router import dispatch

    req = parse_completion_request({"prompt": "a", "n": 2})
    for exc, status in ((ValueError("Value out of range: 5000000000"), 400), (KeyError("x"), 500)):

        def broken(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(dispatch, "choose_pair", broken)
        _, disp = make()
        events = _run_events(disp, req)
        assert sorted(ev.index for ev in events) == [0, 1]
        assert all(ev.error.status == status for ev in events)
        assert disp._active == set()


def test_a_choice_that_never_reports_ends_at_the_deadline(monkeypatch):
    from router import dispatch

    async def silent(self, index):
        await asyncio.sleep(3600)

    monkeypatch.setattr(dispatch.GenerationRun, "_choice", silent)
    monkeypatch.setattr(dispatch, "_EVENT_MARGIN_S", 0.1)
    _, disp = make(request_timeout=0.2)
    events = _run_events(disp, parse_completion_request({"prompt": "a"}))
    assert len(events) == 1 and events[0].error.status == 503
    assert "did not complete within 0.2s" in events[0].error.message
