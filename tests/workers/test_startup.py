"""Start-up (issue 17): a worker reports SERVING only after its warm-up, the warm-up
covers prefill-only, decode and mixed batches and leaves nothing behind, every phase
logs its duration, and Mooncake's own log lines stay out of the terminal unless
--log-level debug asks for them."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from services.engine.warmup import plan
from tests.workers.procs import PDSERVE, Worker
from tests.workers.test_disaggregated import generate

PHASES = ("kernel", "weights", "kv_cache", "cuda_graphs", "warmup", "kv_transfer_registration")
MOONCAKE_NOISE = ("No RDMA devices found", "Local segment descriptor not found")


def _start(model: str, *args: str, env: dict | None = None):
    """A decode worker whose stdout and stderr are kept apart, and a thread that polls
    its gRPC health while it starts: [(seconds, SERVING?, lines logged so far)]."""
    cmd = [*PDSERVE, "decode", "--model", model, "--port", "0", "--num-kv-blocks", "64", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    worker = Worker("decode", proc)
    stderr: list[str] = []
    ready, listening = threading.Event(), threading.Event()

    def pump_out():
        for line in proc.stdout:
            worker.log.append(line)
            if line.startswith("PDSERVE "):
                event = json.loads(line[len("PDSERVE ") :])
                worker.address = event["address"]
                listening.set()
                if event["event"] == "ready":
                    worker.ready_event = event
                    ready.set()

    threading.Thread(target=pump_out, daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    return worker, stderr, ready, listening


def _stop(worker: Worker) -> None:
    worker.stop()


def test_serving_only_after_warmup_and_phases_logged(model):
    worker, stderr, ready, listening = _start(model)
    try:
        assert listening.wait(60), "".join(stderr[-20:])
        polls = []
        while not ready.is_set():
            serving = worker.healthy()
            polls.append((serving, any("warm-up:" in line for line in stderr)))
            if worker.proc.poll() is not None:
                pytest.fail("".join(stderr[-30:]))
            time.sleep(0.05)
        # polled while loading: NOT_SERVING, and never SERVING before the warm-up logged
        assert polls and not polls[0][0]
        assert all(warmed for serving, warmed in polls if serving)
        assert worker.healthy()

        startup = worker.ready_event["startup"]
        for phase in PHASES:
            assert any(name.startswith(phase) for name in startup["phases"]), startup
            assert any(f"start-up: {phase}" in line for line in stderr), phase
        kinds = startup["warmup"]["kinds"]
        assert set(kinds) == {"prefill", "decode", "mixed"}, kinds
        assert startup["warmup"]["role_path"].startswith("decode:")
        # what start-up built is frozen out of the cyclic collector (pdpb/heap.py)
        assert startup["gc_frozen_objects"] > 1000, startup
        assert any("startup objects frozen out of GC" in line for line in stderr)
        assert any("decode worker ready:" in line and "total" in line for line in stderr)

        # nothing left behind: every block free, no request counted, prefix cache empty
        report = worker.load()
        assert report.num_free_blocks == report.num_total_blocks == 64
        tokens, _ = generate(worker, list(range(200, 240)), None, max_tokens=3)
        assert len(tokens) == 3
        # Mooncake's start-up noise stays out of the terminal at the default level
        assert not any(noise in line for line in stderr for noise in MOONCAKE_NOISE)
    finally:
        _stop(worker)


def test_skip_warmup_is_logged_and_debug_shows_mooncake(model):
    worker, stderr, ready, _ = _start(model, "--skip-warmup", "--log-level", "debug")
    try:
        assert ready.wait(120), "".join(stderr[-30:])
        assert worker.ready_event["startup"]["warmup"] is None
        assert any("WARNING" in line and "warm-up skipped" in line for line in stderr)
        deadline = time.monotonic() + 10  # routed by a reader thread: may trail "ready"
        while time.monotonic() < deadline:
            if all(any(n in line for line in stderr) for n in MOONCAKE_NOISE):
                break
            time.sleep(0.05)
        for noise in MOONCAKE_NOISE:
            line = next(line for line in stderr if noise in line)
            assert "DEBUG mooncake:" in line  # through pdserve's logging, not raw glog
    finally:
        _stop(worker)


def test_full_plan_covers_every_graph_size_and_kind():
    graphs = [1, 2, 4, 8, 16, 32, 48, 64]
    shapes = plan(
        max_num_seqs=128,
        max_num_batched_tokens=8192,
        max_model_len=16384,
        block_size=16,
        graph_sizes=graphs,
        full=True,
    )
    decode = {(len(s.rows), s.path) for s in shapes if s.kind == "decode"}
    for b in graphs:
        assert (b, "execute") in decode and (b, "device") in decode
    assert (128, "execute") in decode  # beyond the largest graph: eager
    prefill = sorted(s.num_tokens for s in shapes if s.kind == "prefill")
    assert prefill[-1] == 8192 and 17 in prefill and 128 in prefill
    eager_ctx = {s.max_seq_len for s in shapes if s.kind == "decode" and len(s.rows) == 128}
    assert len(eager_ctx) >= 8  # context lengths stepping through the split counts
    assert any(s.kind == "mixed" and s.num_tokens == 8192 for s in shapes)
    prefill_only = plan(
        max_num_seqs=128,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        block_size=16,
        graph_sizes=graphs,
        full=True,
        role="prefill",
    )
    assert {s.kind for s in prefill_only} == {"prefill"}
