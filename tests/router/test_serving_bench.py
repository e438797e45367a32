"""benchmarks/serving_bench.py against a router in front of real prefill and decode
workers: its counts, latencies and the router's own histograms, one client process or
several pooled."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

# pair and router: test_integration's fixtures (a worker pair, a router in front)
from tests.router.test_integration import SERVED, assert_all_blocks_free, pair, router  # noqa: F401


def test_serving_benchmark_against_real_workers(router, pair):  # noqa: F811
    """benchmarks/serving_bench.py: every streamed request is timed and counted, a
    rejected one is reported as failed (not raised), and the workers end with every
    KV block free."""
    from benchmarks.serving_bench import run_benchmark, run_clients

    s = asyncio.run(
        run_benchmark(
            router.url,
            num_prompts=6,
            input_len=40,
            output_len=8,
            max_concurrency=3,
            request_rate=50.0,
            seed=1,
        )
    )
    assert s["model"] == SERVED
    assert (s["completed"], s["failed"]) == (6, 0), s["first_error"]
    for r in s["requests"]:
        assert (r["prompt_tokens"], r["output_tokens"]) == (40, 8)
        assert 0 < r["ttft"] < r["e2e"] and r["itl"] >= 1
    assert 0 < s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert s["output_throughput"] > 0 and s["tpot_ms"]["mean"] > 0
    # the router's own histograms over exactly these requests split the TTFT
    server = s["server_ms"]
    assert server["prefill_time_ms"] > 0 and server["kv_transfer_time_ms"] > 0
    assert server["time_to_first_token_ms"] > server["prefill_time_ms"]
    assert s["cached_prompt_tokens"] == 0  # every prompt its own

    # a shared 32-token prefix (two blocks) is cached after the warm-up request
    shared = asyncio.run(
        run_benchmark(
            router.url, num_prompts=4, input_len=40, output_len=4, shared_prefix_len=32, seed=2
        )
    )
    assert (shared["completed"], shared["failed"]) == (4, 0), shared["first_error"]
    assert shared["cached_prompt_tokens"] == 4 * 32

    too_long = router.state.registry.max_model_len() + 1
    bad = asyncio.run(
        run_benchmark(router.url, num_prompts=1, input_len=too_long, output_len=4, warmup=0)
    )
    assert (bad["completed"], bad["failed"]) == (0, 1)
    assert bad["first_error"].startswith("HTTP 400")

    # two client processes that start together, their requests pooled
    pooled = run_clients(
        router.url, clients=2, num_prompts=5, input_len=40, output_len=8, max_concurrency=4
    )
    assert (pooled["completed"], pooled["failed"], pooled["clients"]) == (5, 0, 2)
    assert all(r["output_tokens"] == 8 and r["itl"] >= 1 for r in pooled["requests"])
    # every client's inter-token gaps in one distribution
    assert pooled["itl_ms"]["n"] == sum(r["itl"] for r in pooled["requests"])
    assert 0 < pooled["itl_ms"]["median"] <= pooled["itl_ms"]["p99"] <= pooled["e2e_ms"]["p99"]
    assert pooled["server_ms"]["prefill_time_ms"] > 0  # the router's, over both clients
    assert pooled["output_throughput"] > 0
    assert_all_blocks_free(pair)


def test_router_overhead_clients_pool_every_path(router, pair):  # noqa: F811
    """benchmarks/router_overhead.py --clients: two client processes share each wave's
    streams on every path (the router, direct Generate, the shared GenerateStream);
    every request of every wave comes back with all its tokens, pooled per path."""
    from benchmarks.router_overhead import run_clients, summarize

    prefill, decode = pair
    paths = run_clients(
        router.url, decode.address, prefill.address, n=3, max_tokens=4, rounds=2, clients=2,
        model=SERVED,
    )  # fmt: skip
    assert set(paths) == {"router", "direct gRPC", "direct GenerateStream"}
    for name, results in paths.items():
        assert len(results) == 2 * 3, name  # two waves of three streams, from both clients
        assert all(len(stamps) == 4 and stamps[0] > start for start, stamps in results), name
        s = summarize(results)
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["itl_p50_ms"] > 0, name
    assert_all_blocks_free(pair)


def test_router_overhead_shows_why_a_worker_did_not_start(tmp_path):
    """A worker that exits before it is ready ends the benchmark's wait at once, with
    the worker's own last lines in the error (the output is not echoed otherwise)."""
    from benchmarks.router_overhead import start_worker

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not become ready") as err:
        start_worker("decode", "--no-such-flag", model=str(tmp_path))
    assert "--no-such-flag" in str(err.value)  # argparse's complaint, from the worker
    assert time.monotonic() - start < 60  # not the 300 s readiness limit


def _pids_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            pass
    return pids


def test_router_overhead_stops_its_workers_on_sigterm():
    """`timeout` ends the benchmark with SIGTERM while a worker starts: the worker, in a
    session of its own, is stopped too (it used to outlive the benchmark and hold the
    GPU), and where its start had got to is printed."""
    marker = "4321"  # the benchmark passes --max-num-seqs <largest concurrency>
    bench = subprocess.Popen(
        [sys.executable, "benchmarks/router_overhead.py", "--concurrency", marker],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (workers := [p for p in _pids_with(marker) if p != bench.pid]):
        assert bench.poll() is None and time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=60)
    assert "prefill worker did not become ready" in err
    deadline = time.monotonic() + 15
    while set(workers) & set(_pids_with(marker)):
        assert time.monotonic() < deadline, f"worker {workers} outlived the benchmark"
        time.sleep(0.1)


def test_a_signal_during_a_worker_spawn_is_held_until_the_worker_can_be_stopped():
    """SIGTERM that lands while the worker process is being created (Popen has forked,
    nothing holds the Child yet) is delivered only once start_worker can stop it; raised
    at once, it left the worker running (CI hit this window)."""
    from benchmarks.router_overhead import _HeldSignals, _interrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        signals = _HeldSignals()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # a handler that raised would have raised by now
        assert signals.held == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            signals.release()
        assert signal.getsignal(signal.SIGTERM) is _interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_first_token_stages_stamps_every_stage(tmp_path):
    """benchmarks/first_token_stages.py: every stamp along both paths is reached (a
    renamed router or worker function would leave its stage out, or fail the start)."""
    model = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "benchmarks/dummy_model.py", "--config",
         "benchmarks/configs/tiny-llama.json", "--out", str(model)],
        check=True, timeout=120,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "benchmarks/first_token_stages.py", "--model", str(model),
         "--load-format", "dummy", "--requests", "3", "--max-tokens", "2", "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    routed, direct = out.stdout.split("straight to GenerateStream")
    for stage in ("router: handler", "router: dispatched", "router: stream open",
                  "router: gRPC write", "router: gRPC write done", "worker: start",
                  "worker: first response", "worker: sent", "router: first response",
                  "router: SSE headers", "router: SSE write", "client: first token"):  # fmt: skip
        assert f"| {stage} |" in routed, stage
    for stage in ("worker: start", "worker: first response", "worker: sent", "client: first token"):
        assert f"| {stage} |" in direct, stage
