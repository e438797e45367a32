"""Tensor parallelism, acceptance 4: `pdserve up` with a TP=3 prefill worker and a TP=1
decode worker on CPU (real processes: router, workers, rank processes) answers an
OpenAI completion exactly as the colocated engine does, and stops every process. The
decode worker runs its engine in a process of its own (--decode-engine-process), which
stops with it too.
The default model (SmolLM2-135M: 9 heads, 3 KV heads) splits over 3 ranks, not 2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_up_with_a_tensor_parallel_prefill_worker(default_model_dir):
    import openai

    from services.engine import LLM, SamplingParams
    from tests.workers.procs import Worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", str(default_model_dir)]
    cmd += ["--port", str(port), "--prefill-tp", "3", "--decode-tp", "1", "--decode-engine-process"]
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
        assert ready.wait(300), "".join(lines[-30:])
        workers = _children(proc.pid)
        # rank processes: the workers' multiprocessing children
        ranks = [r for w in workers for r in _children(w) if "spawn_main" in _cmdline(r)]
        # (the decode worker's one child is its engine process)
        assert len(ranks) >= 3, "the prefill worker has no rank processes"
        decode_pid = next(w for w in workers if " decode " in _cmdline(w))
        assert [r for r in _children(decode_pid) if "spawn_main" in _cmdline(r)]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        prompt = "The capital of France is"
        out = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8)
        with LLM(str(default_model_dir)) as llm:
            ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
        assert out.choices[0].text == ref.output.text
        for role in ("prefill", "decode"):
            line = next(x for x in lines if x.startswith(f"[{role}-0] PDSERVE "))
            address = json.loads(line.split("PDSERVE ", 1)[1])["address"]
            report = Worker(role, proc, address).wait_all_blocks_free(timeout=5)
            assert report.num_free_blocks == report.num_total_blocks > 0
            if role == "prefill":
                assert report.kv_transfers_ok == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-30:])
    assert not [r for r in ranks if _alive(r)], "a rank or engine process outlived pdserve up"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
