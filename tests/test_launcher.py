"""`pdserve up`: which device(s) each worker gets, tensor-parallel workers' GPU ranges,
and bad device / TP flags refused before any process starts."""

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


def test_bad_tool_flags_are_refused_before_starting(capsys):
    assert main(["up", "--tool-call-parser", "pythonic", "--port", "1"]) == 2
    assert "--tool-call-parser 'pythonic': choose one of hermes" in capsys.readouterr().err
    assert main(["up", "--enable-auto-tool-choice", "--port", "1"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_bad_api_server_count_is_refused_before_starting(capsys):
    assert main(["up", "--api-server-count", "0", "--port", "1"]) == 2
    assert "--api-server-count must be >= 1, got 0" in capsys.readouterr().err


def test_hint_when_gpu_workers_would_move_kv_over_tcp():
    from pdserve.launcher import transport_hint

    gpus = plan_workers(_args(prefill_device="cuda:0", decode_device="cuda:1"))
    assert "nvlink_intra" in transport_hint(gpus, [])
    assert transport_hint(gpus, ["--transfer-protocol", "nvlink_intra"]) is None
    assert transport_hint(gpus, ["--transfer-protocol=rdma"]) is None
    assert transport_hint(plan_workers(_args()), []) is None  # CPU
    assert transport_hint(plan_workers(_args(prefill=0, device="cuda")), []) is None


def test_tensor_parallel_workers_get_consecutive_gpus():
    from pdserve.launcher import gpu_range

    args = _args(prefill=1, decode=2, prefill_device="cuda:0", decode_device="cuda:2,cuda:4")
    plan = plan_workers(argparse.Namespace(**vars(args), prefill_tp=2, decode_tp=2))
    assert plan == [("prefill-0", "cuda:0"), ("decode-0", "cuda:2"), ("decode-1", "cuda:4")]
    assert [list(gpu_range(d, 2)) for _, d in plan] == [[0, 1], [2, 3], [4, 5]]
    assert gpu_range("cuda", 3) == range(0, 3) and gpu_range("cpu", 4) is None
    # a single-GPU decode worker right after a TP=2 prefill worker
    plan_workers(_args(prefill_device="cuda:0", decode_device="cuda:2", prefill_tp=2))


@pytest.mark.parametrize(
    "kw,expected",
    [
        (  # prefill on GPUs 0-1, decode on GPU 1
            dict(prefill_device="cuda:0", decode_device="cuda:1", prefill_tp=2),
            "prefill-0 (--prefill-device cuda:0, --prefill-tp 2: GPUs 0-1) and decode-0 "
            "(--decode-device cuda:1, --decode-tp 1: GPU 1) share GPU 1",
        ),
        (  # --device for both roles: the same start GPU
            dict(device="cuda", decode_tp=4),
            "prefill-0 (--device cuda, --prefill-tp 1: GPU 0) and decode-0 "
            "(--device cuda, --decode-tp 4: GPUs 0-3) share GPU 0",
        ),
        (  # two TP=2 decode workers cycled onto overlapping GPUs
            dict(prefill=0, decode=2, decode_device="cuda:0,cuda:1", decode_tp=2),
            "decode-0 (--decode-device cuda:0, --decode-tp 2: GPUs 0-1) and decode-1 "
            "(--decode-device cuda:1, --decode-tp 2: GPUs 1-2) share GPU 1",
        ),
    ],
)
def test_overlapping_gpu_ranges_are_refused(kw, expected):
    with pytest.raises(ValueError) as err:
        plan_workers(_args(**kw))
    assert expected in str(err.value)
    assert "--prefill-device / --decode-device" in str(err.value)


def test_single_gpu_workers_may_still_share_and_cpu_ignores_tp():
    plan_workers(_args(prefill=2, decode=2, device="cuda:0"))  # TP 1: allowed, as before
    plan = plan_workers(_args(prefill=2, decode=2, prefill_tp=2, decode_tp=4))
    assert {d for _, d in plan} == {"cpu"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prefill-tp", "0"], "--prefill-tp must be an integer >= 1, got 0"),
        (["--decode-tp", "-2"], "--decode-tp must be an integer >= 1, got -2"),
        (
            ["--prefill-tp", "2", "--device", "cuda:0"],
            "prefill-0 (--device cuda:0, --prefill-tp 2: GPUs 0-1) and decode-0",
        ),
        (["--", "--tensor-parallel-size", "2"], "use --prefill-tp / --decode-tp"),
        (["--", "-tp=2"], "use --prefill-tp / --decode-tp"),
        (["--", "--tensor-para", "2"], "use --prefill-tp / --decode-tp"),
    ],
)
def test_bad_tensor_parallel_flags_are_refused_before_starting(argv, message, capsys):
    assert main(["up", "--port", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_tp_reaches_every_worker_of_its_role(monkeypatch):
    """run_up gives each worker `--tensor-parallel-size` of its role (1 by default)."""
    import signal
    import threading

    from pdserve import launcher

    started: list[list[str]] = []

    class FakeChild:  # exits at once, so run_up stops after starting the workers
        def __init__(self, name, cmd, env, echo=True):
            self.name, self.ready = name, threading.Event()
            self.proc = argparse.Namespace(poll=lambda: 1)
            started.append(cmd)

        def stop(self, timeout):
            pass

    monkeypatch.setattr(launcher, "Child", FakeChild)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    args = _args(prefill=1, decode=2, prefill_tp=2, decode_tp=1, model="m", reasoning_parser=None)
    assert launcher.run_up(args, ["--max-num-seqs", "8"]) == 1
    from pdserve.cli import build_parser

    parsed = [build_parser().parse_args(cmd[len(launcher.PDSERVE) :]) for cmd in started]
    assert [(p.command, p.tensor_parallel_size, p.max_num_seqs) for p in parsed] == [
        ("prefill", 2, 8),
        ("decode", 1, 8),
        ("decode", 1, 8),
    ]


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
    cmd += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]  # likewise
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
        # the tool flags reached the router: a request with tools (tool_choice "auto")
        # is served, not refused
        tool = {"type": "function", "function": {"name": "f"}}
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], tools=[tool], max_tokens=2
        )
        assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")
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


def test_the_readiness_probe_takes_a_non_http_answer_as_not_ready():
    """A gRPC worker on the router's port answers the probe with HTTP/2 bytes: that is
    not the router, and `pdserve up` must keep waiting, not crash on BadStatusLine (CI
    saw it when a worker had taken the router's port)."""
    import socket
    import threading

    from pdserve.launcher import _ready

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def answer_in_http2():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff\n")
        conn.close()

    thread = threading.Thread(target=answer_in_http2, daemon=True)
    thread.start()
    try:
        assert _ready(f"http://127.0.0.1:{port}") is False
    finally:
        thread.join(5)
        server.close()


def test_the_router_port_is_held_while_the_workers_start():
    """_reserve_port binds the router's address without SO_REUSEADDR, so no other socket
    (a worker's bind to port 0 included) gets it until the router starts; a port that
    is already taken gives None (the router then reports it)."""
    import socket

    from pdserve.launcher import _reserve_port

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    held = _reserve_port("127.0.0.1", port)
    assert held is not None
    try:
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        assert _reserve_port("127.0.0.1", port) is None
    finally:
        held.close()
    with socket.socket() as router:  # released: the router binds it
        router.bind(("127.0.0.1", port))
