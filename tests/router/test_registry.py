"""Worker registry: health checking, pairing, discovery; retries when workers vanish."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest

from router.config import RouterConfig
from router.discovery import resolve
from router.registry import WorkerRegistry
from tests.router.control_plane import ControlPlane
from tests.router.helpers import RouterThread, http


def config(**kw) -> RouterConfig:
    kw = {"health_interval": 0.1, "health_timeout": 1.0, **kw}
    return RouterConfig(host="127.0.0.1", port=0, **kw)


async def until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def test_health_transitions():
    async def main():
        d = await ControlPlane("decode").start(serving=False)
        p = await ControlPlane("prefill").start()
        reg = WorkerRegistry(config(decode=(d.address,), prefill=(p.address,)))
        await reg.start()
        try:
            [dw] = reg.of_role("decode")
            await until(lambda: reg.healthy("prefill") and "NOT_SERVING" in dw.error)
            assert not reg.ready() and reg.healthy("decode") == []
            await d.set_serving(True)  # the model finished loading
            await until(reg.ready)
            assert dw.peers == {p.address: dw.peers[p.address]}
            assert dw.peers[p.address].state == "ok"
            assert reg.models() == ["m"] and reg.max_model_len() == 128
            await d.stop()  # the decode worker dies: out within a probe or two
            await until(lambda: not dw.healthy)
            assert not reg.ready() and "UNAVAILABLE" in dw.error
            await d.start()  # back on the same port: healthy again, paired again
            await until(reg.ready)
            assert d.peer_calls == [p.address] * 2  # the new process got the handshake too
        finally:
            await reg.close()
            await p.stop()
            await d.stop()

    asyncio.run(main())


def test_a_busy_worker_gets_a_few_late_probes_before_it_is_out(caplog):
    """A probe that times out on a live worker counts toward health_failure_threshold
    (3) in a row; a refused connection counts at once (test_health_transitions)."""

    async def main():
        d = await ControlPlane("decode").start()
        cfg = config(decode=(d.address,), health_timeout=0.2, health_failure_threshold=3)
        reg = WorkerRegistry(cfg)
        await reg.start()
        try:
            [dw] = reg.of_role("decode")
            await until(lambda: dw.healthy)
            d.slow_load_s = 0.5
            d.slow_loads = 2  # two late answers: still in the pool
            await until(lambda: d.slow_loads == 0 and dw.slow_probes == 0 and d.load_calls > 3)
            assert dw.healthy and "is unhealthy" not in caplog.text
            d.slow_loads = 4  # a third late answer in a row: out, then back once it answers
            await until(lambda: not dw.healthy)
            assert "DEADLINE_EXCEEDED" in dw.error
            await until(lambda: dw.healthy)
        finally:
            await reg.close()
            await d.stop()

    with caplog.at_level(logging.INFO, logger="pdserve.router.registry"):
        asyncio.run(main())


def test_incompatible_pairs_are_not_used(caplog):
    async def main():
        d = await ControlPlane("decode").start()
        good = await ControlPlane("prefill").start()
        bad = await ControlPlane("prefill").start()
        other = await ControlPlane("prefill", model="another-model").start()
        d.incompatible.add(bad.address)
        reg = WorkerRegistry(
            config(decode=(d.address,), prefill=(good.address, bad.address, other.address))
        )
        await reg.start()
        try:
            [dw] = reg.of_role("decode")
            await until(
                lambda: len(dw.peers) == 3 and "pending" not in {x.state for x in dw.peers.values()}
            )
            assert dw.peers[good.address].state == "ok"
            assert dw.peers[bad.address].state == "incompatible"
            assert "block_size" in dw.peers[bad.address].detail
            assert dw.peers[other.address].state == "incompatible"
            assert other.address not in d.peer_calls  # different models: not even asked
            assert [(x.address, y.address) for x, y in reg.usable_pairs()] == [
                (d.address, good.address)
            ]
        finally:
            await reg.close()
            for cp in (d, good, bad, other):
                await cp.stop()

    with caplog.at_level(logging.ERROR, logger="pdserve.router.registry"):
        asyncio.run(main())
    assert any(
        "incompatible" in r.getMessage() and "block_size" in r.getMessage() for r in caplog.records
    )


def test_wrong_role_is_unhealthy():
    async def main():
        p = await ControlPlane("prefill").start()
        p.reported_role = "decode"  # a decode worker given as --prefill
        reg = WorkerRegistry(config(prefill=(p.address,)))
        await reg.start()
        try:
            [w] = reg.of_role("prefill")
            await until(lambda: "registered as a prefill worker" in w.error)
            assert not w.healthy
        finally:
            await reg.close()
            await p.stop()

    asyncio.run(main())


def test_dns_names_and_admin_targets():
    async def main():
        assert await resolve("localhost:5") == {"127.0.0.1:5"}
        assert await resolve("10.1.2.3:5") == {"10.1.2.3:5"}
        assert await resolve("[::1]:5") == {"[::1]:5"}
        with pytest.raises(OSError):
            await resolve("no-such-host.invalid:5")
        d = await ControlPlane("decode").start()
        reg = WorkerRegistry(config(decode=(f"localhost:{d.port}", "no-such-host.invalid:1")))
        await reg.start()
        try:
            await until(lambda: reg.healthy("decode"))
            assert [w.address for w in reg.of_role("decode")] == [d.address]
            # the same worker under another name is still one worker
            assert await reg.add_target("decode", d.address) == [d.address]
            assert len(reg.workers) == 1
            assert reg.remove_target("decode", f"localhost:{d.port}")
            assert len(reg.workers) == 1  # still wanted through its other target
            assert reg.remove_target("decode", d.address) and reg.workers == {}
            assert not reg.remove_target("decode", d.address)
            with pytest.raises(ValueError):
                await reg.add_target("router", d.address)
        finally:
            await reg.close()
            await d.stop()

    asyncio.run(main())


def test_vanished_workers_are_retried_then_503():
    """Both decode workers die between probes: the request tries each pair once, answers
    503, and the failure makes the registry re-probe at once (no 30 s wait)."""
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        health_interval=30,
        health_timeout=1.0,
        max_retries=2,
        served_model_name="m",
    )
    with RouterThread(cfg) as r:
        d1, d2, p = (r.call(ControlPlane(role).start()) for role in ("decode", "decode", "prefill"))
        reg = r.state.registry
        for role, cp in (("decode", d1), ("decode", d2), ("prefill", p)):
            r.call(reg.add_target(role, cp.address))
        r.call(until(lambda: len(reg.usable_pairs()) == 2))
        assert http("GET", r.url + "/ready").status == 200
        r.call(d1.stop())
        r.call(d2.stop())
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert e.value.status_code == 503 and "UNAVAILABLE" in e.value.body["message"]
        r.call(until(lambda: not reg.ready(), timeout=5))
        assert http("GET", r.url + "/ready").status == 503
        assert sum(w.requests for w in reg.of_role("decode")) >= 1
        assert all(w.inflight == 0 for w in reg.workers.values())
        r.call(p.stop())


def test_colocated_only_without_any_prefill_target():
    async def main():
        d = await ControlPlane("decode").start()
        reg = WorkerRegistry(config(decode=(d.address,)))
        await reg.start()
        try:
            await until(reg.ready)
            [(dw, local)] = reg.usable_pairs()
            assert reg.colocated and dw.address == d.address and local.address == ""
            assert d.peer_calls == []  # nothing to shake hands with
            # a prefill name that resolves to no worker yet (pods starting): no pairs,
            # rather than decode workers silently prefilling on their own
            await reg.add_target("prefill", "prefill.invalid:7000")
            assert not reg.colocated and reg.usable_pairs() == [] and not reg.ready()
            assert reg.remove_target("prefill", "prefill.invalid:7000")
            assert reg.colocated and reg.ready()
        finally:
            await reg.close()
            await d.stop()

    asyncio.run(main())
