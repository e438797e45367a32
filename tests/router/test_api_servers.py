"""--api-server-count: several router processes on one port (router/api_servers.py),
against real prefill and decode workers through the official openai client.

Answers equal the colocated engine's and both processes serve; every /metrics scrape,
whichever process answers it, reports the totals of all of them; the concurrency limit
holds for the router as a whole; SIGTERM ends every process, an API server that dies
takes the others down with it, and so does a supervisor that is killed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from router.limits import SharedConcurrencyLimit, key_digest
from tests.chaos.stack import (
    Stack,
    assert_blocks_back,
    get,
    prompts,
    references,
    run_streams,
    run_streams_with,
    until,
)

SERVERS = 2
STREAMS = 12
TOKENS = 12


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the field after the ")" that ends the command name: state, then ppid
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _alive(p)]}"
        time.sleep(0.05)


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value, from a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a metric's series whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


@pytest.fixture(scope="module")
def stack(model):
    with Stack(
        model, router_args=("--api-server-count", str(SERVERS), "--log-level", "DEBUG")
    ) as s:
        yield s


def test_processes_share_the_port_and_answer_right(stack, colocated):
    router = stack.router
    servers = _children(router.proc.pid)
    assert len(servers) == SERVERS, servers
    texts = prompts(STREAMS, "asc")
    refs = references(colocated, texts, TOKENS)
    outs = asyncio.run(run_streams(router.url, texts, TOKENS))
    assert [o.kind for o in outs] == ["ok"] * STREAMS, [o.detail for o in outs]
    assert [o.text for o in outs] == refs
    # each connection lands on one process (SO_REUSEPORT): with 12, both serve
    served = {
        m.group(1)
        for line in router.log
        if (m := re.search(r"pdserve\.router\[(\d+)\]: \[[^]]+\] /v1/completions done", line))
    }
    assert served == {str(i) for i in range(SERVERS)}, "".join(router.log[-40:])
    assert_blocks_back(stack.workers)


def test_every_scrape_reports_all_processes(stack):
    router = stack.router
    texts = prompts(STREAMS, "metrics")
    before = _samples(get(router.url + "/metrics")[1])
    outs = asyncio.run(run_streams(router.url, texts, TOKENS))
    assert [o.kind for o in outs] == ["ok"] * STREAMS
    decode = stack.decodes[0].address
    for _ in range(8):  # a new connection each: both processes answer some of them
        status, text = get(router.url + "/metrics")
        assert status == 200, text
        now = _samples(text)

        def grew(name, now=now, **labels):
            return _metric(now, name, **labels) - _metric(before, name, **labels)

        assert grew("pdserve_router_requests_total", endpoint="/v1/completions") == STREAMS
        assert grew("vllm:request_success_total") == STREAMS
        assert grew("vllm:generation_tokens_total") == STREAMS * TOKENS
        assert grew("pdserve_router_generation_tokens_total") == STREAMS * TOKENS
        assert grew("vllm:time_to_first_token_seconds_count") == STREAMS
        assert (
            grew("pdserve_router_worker_requests_total", role="decode", address=decode) == STREAMS
        )
        assert _metric(now, "pdserve_router_inflight_requests") == 0
        assert _metric(now, "pdserve_router_worker_inflight", role="decode") == 0
        assert _metric(now, "pdserve_router_worker_healthy", role="decode", address=decode) == 1


def test_every_process_freezes_its_startup_heap_and_reports_gc_pauses(stack):
    """Each API server and each worker freezes what it built at start-up out of the
    cyclic collector (pdpb/heap.py) before serving, and counts the collector's pauses."""
    router = stack.router
    frozen = {
        m.group(1): int(m.group(2))
        for line in router.log
        if (m := re.search(r"pdserve\.router\[(\d+)\]: (\d+) startup objects frozen", line))
    }
    assert set(frozen) == {str(i) for i in range(SERVERS)}, "".join(router.log[-40:])
    assert all(n > 1000 for n in frozen.values()), frozen
    for worker in stack.workers:
        ready = next(
            json.loads(line[len("PDSERVE ") :])
            for line in worker.log
            if line.startswith("PDSERVE ") and '"ready"' in line
        )
        assert ready["startup"]["gc_frozen_objects"] > 1000, ready
    # serving allocates: young collections happen, and their pauses reach /metrics
    outs = asyncio.run(run_streams(router.url, prompts(STREAMS, "gc"), TOKENS))
    assert [o.kind for o in outs] == ["ok"] * STREAMS
    assert_blocks_back(stack.workers)

    def young_pauses() -> float:
        return _metric(
            _samples(get(router.url + "/metrics")[1]),
            "pdserve_router_gc_pause_seconds_count",
            generation="0",
        )

    deadline = time.monotonic() + 10
    while young_pauses() == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert young_pauses() > 0


def test_clients_hanging_up_free_the_workers_blocks_within_a_second(stack):
    """Long streams through both processes, every client gone mid-stream: the API
    servers cancel their worker requests and both workers hold no block a second
    later."""
    router = stack.router

    class HungUp(Exception):
        pass

    async def hang_up(outs):
        await until(lambda: all(o.chunks >= 2 for o in outs), 120, "every stream decoding")
        raise HungUp  # leaving cancels every stream and closes the client (run_streams_with)

    texts = prompts(STREAMS, "gone")
    with pytest.raises(HungUp):
        asyncio.run(run_streams_with(router.url, texts, 2000, hang_up))
    assert_blocks_back(stack.workers, timeout=1.0)


def test_the_concurrency_limit_holds_across_processes(stack, colocated):
    """4 slots, 12 long streams at once: 4 answered, 8 refused with 429, however the
    connections fall on the two processes (per process, up to 8 would start)."""
    stack.router_args = ("--api-server-count", str(SERVERS), "--max-concurrent-requests", "4")
    router = stack.start_router()
    router.wait_ready(pairs=1)
    texts = prompts(STREAMS, "limit")
    outs = asyncio.run(run_streams(router.url, texts, 64))
    kinds = sorted(o.kind for o in outs)
    assert kinds == ["http_error"] * 8 + ["ok"] * 4, [o.detail for o in outs]
    assert {o.status for o in outs if o.kind == "http_error"} == {429}
    assert all(o.error["type"] for o in outs if o.kind == "http_error")
    assert_blocks_back(stack.workers)
    _, text = get(router.url + "/metrics")
    assert _metric(_samples(text), "pdserve_router_requests_total", status="429") == 8


def test_sigterm_ends_every_process(stack):
    router = stack.start_router()
    router.wait_ready(pairs=1)
    servers = _children(router.proc.pid)
    assert len(servers) == SERVERS
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(30) == 0
    _wait_gone(servers, 5)
    assert get(router.url + "/ready")[0] == 0  # nothing listens any more


def test_a_dead_api_server_stops_the_router(stack):
    router = stack.start_router()
    router.wait_ready(pairs=1)
    servers = _children(router.proc.pid)
    os.kill(servers[0], signal.SIGKILL)
    assert router.proc.wait(30) == 1
    _wait_gone(servers, 5)
    assert any("API server 0 exited" in line for line in router.log), "".join(router.log)


def test_api_servers_stop_when_the_supervisor_is_killed(stack):
    router = stack.start_router()
    router.wait_ready(pairs=1)
    servers = _children(router.proc.pid)
    router.proc.kill()
    router.proc.wait(10)
    _wait_gone(servers, 15)  # their stdin closes: each shuts down


@pytest.mark.parametrize(
    "args, message",
    [
        (["--api-server-count", "0"], "api_server_count must be >= 1"),
        (["--api-server-count", "2", "--admin-token", "t"], "need --api-server-count 1"),
    ],
)
def test_bad_counts_are_refused(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "router", "--decode", "127.0.0.1:1", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_a_port_in_use_is_refused_not_shared():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1"]
            + ["--port", str(port), "--decode", "127.0.0.1:1", "--api-server-count", "2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr


def test_shared_limit_counts_every_holder(tmp_path):
    """Two holders of one counts file, as two processes: the limits are the router's."""
    path = str(tmp_path / "limits")
    keys = [key_digest("a"), key_digest("b")]
    SharedConcurrencyLimit.create(path, len(keys))
    one = SharedConcurrencyLimit(path, 3, 2, keys)
    two = SharedConcurrencyLimit(path, 3, 2, keys)
    try:
        assert one.try_acquire(keys[0]) and two.try_acquire(keys[0])
        assert not one.try_acquire(keys[0]) and two.key_full(keys[0])  # key a: 2 of 2
        assert two.try_acquire(keys[1])
        assert not one.try_acquire(None) and one.inflight == 3  # all 3 slots
        one.release(keys[0])
        assert two.try_acquire(None) and one.inflight == 3
        two.release(None)
        two.release(keys[0])
        one.release(keys[1])
        assert one.inflight == two.inflight == 0 and not one.key_full(keys[0])
        with pytest.raises(ValueError):
            SharedConcurrencyLimit(path, -1, 0, keys)
    finally:
        one.close()
        two.close()
