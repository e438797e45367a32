"""`pdserve up`: which device each worker gets, and bad device flags refused before any
process starts."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.cli import main
from pdserve.launcher import plan_workers


def _args(**kw) -> argparse.Namespace:
    base = {"prefill": 1, "decode": 1, "device": "cpu", "prefill_device": None}
    return argparse.Namespace(**{**base, "decode_device": None, **kw})


def test_every_worker_on_device_by_default():
    assert plan_workers(_args(prefill=2, decode=1, device="cuda")) == [
        ("prefill-0", "cuda"),
        ("prefill-1", "cuda"),
        ("decode-0", "cuda"),
    ]


def test_role_devices_are_cycled_per_worker():
    plan = plan_workers(
        _args(prefill=1, decode=3, prefill_device="cuda:0", decode_device="cuda:1, cuda:2")
    )
    assert plan == [
        ("prefill-0", "cuda:0"),
        ("decode-0", "cuda:1"),
        ("decode-1", "cuda:2"),
        ("decode-2", "cuda:1"),
    ]


def test_no_prefill_workers_is_colocated_decode():
    assert plan_workers(_args(prefill=0, decode_device="cuda:3")) == [("decode-0", "cuda:3")]


@pytest.mark.parametrize("flag", ["--device", "--prefill-device", "--decode-device"])
def test_bad_device_is_refused_before_starting(flag, capsys):
    assert main(["up", flag, "gpu0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: 'gpu0' is not cpu, cuda or cuda:N" in err


def test_bad_reasoning_parser_is_refused_before_starting(capsys):
    assert main(["up", "--reasoning-parser", "qwen9", "--port", "1"]) == 2
    assert "--reasoning-parser 'qwen9': choose one of" in capsys.readouterr().err


def test_hint_when_gpu_workers_would_move_kv_over_tcp():
    from pdserve.launcher import transport_hint

    gpus = plan_workers(_args(prefill_device="cuda:0", decode_device="cuda:1"))
    assert "nvlink_intra" in transport_hint(gpus, [])
    assert transport_hint(gpus, ["--transfer-protocol", "nvlink_intra"]) is None
    assert transport_hint(gpus, ["--transfer-protocol=rdma"]) is None
    assert transport_hint(plan_workers(_args()), []) is None  # CPU
    assert transport_hint(plan_workers(_args(prefill=0, device="cuda")), []) is None


def test_up_colocated_answers_and_stops_cleanly(default_model_dir):
    """`pdserve up --prefill 0`: one decode worker that prefills itself behind the router
    (real processes); a completion equals the colocated engine's, SIGTERM stops all."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading

    import openai

    from services.engine import LLM, SamplingParams

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", str(default_model_dir)]
    cmd += ["--port", str(port), "--prefill", "0", "--decode", "1"]
    cmd += ["--reasoning-parser", "deepseek_r1"]  # reaches the router (checked below)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pdserve is ready"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(180), "".join(lines[-30:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        out = client.completions.create(
            model=model, prompt="The capital of France is", temperature=0, max_tokens=8
        )
        params = SamplingParams(temperature=0, max_tokens=8)
        ref = LLM(str(default_model_dir)).generate(["The capital of France is"], params)[0]
        assert out.choices[0].text == ref.output.text
        assert any("colocated" in line for line in lines), "".join(lines[-30:])
        # --reasoning-parser reached the router: deepseek_r1 reads an output without
        # </think> as all reasoning
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=8
        )
        message = chat.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") and not message.content
        # the decode worker's own report: every KV block free again
        from tests.workers.procs import Worker

        announce = next(line for line in lines if line.startswith("[decode-0] PDSERVE "))
        address = json.loads(announce.split("PDSERVE ", 1)[1])["address"]
        report = Worker("decode", proc, address).wait_all_blocks_free(timeout=5)
        assert report.num_free_blocks == report.num_total_blocks > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
