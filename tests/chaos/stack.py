"""Real stacks for the chaos tests: prefill and decode worker processes
(tests/workers/procs.py), a router process (`pdserve router`), concurrent streaming
load through the official `openai` client, and the accounting every scenario ends
with. Whatever a test does to the processes (SIGKILL, SIGSTOP), `Stack` resumes and
ends every one of them when the test leaves, failed or not."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai

from tests.workers.procs import Worker

SERVED = "smollm2"
# One torch thread per process: a stack is 3-5 processes on a 2-core CI machine, and
# torch's default (a thread per core, spinning at each barrier) makes oversubscribed
# processes ~10x slower. The references are computed with one thread too.
THREADS = 1
CHILD_ENV = {"GLOG_minloglevel": "2", "OMP_NUM_THREADS": str(THREADS)}
PDSERVE = [sys.executable, "-m", "pdserve"]


_T0 = time.monotonic()


def note(*parts) -> None:
    """A timestamped progress line (shown with -s, and in the report of a failure)."""
    print(f"[chaos {time.monotonic() - _T0:7.2f}s]", *parts, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, so a test
    process killed from outside (a CI timeout) leaves no worker behind. The signal is
    tied to the thread that forked, so children are started from the main thread."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    assert threading.current_thread() is threading.main_thread(), "spawn from the main thread"
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **CHILD_ENV, **(env or {})},
        preexec_fn=_die_with_parent,
    )


def _pump(proc: subprocess.Popen, lines: list[str], on_line=None) -> threading.Thread:
    def run():
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def spawn_worker(role: str, model: str, *args: str, env: dict | None = None):
    """A worker process (as tests/workers/procs.py starts them, but dying with the test
    process); returns (Worker, event set once it is ready)."""
    cmd = [*PDSERVE, role, "--model", model, "--port", "0", "--num-kv-blocks", "256"]
    cmd += ["--skip-warmup", *args]
    worker = Worker(role, spawn(cmd, env))
    ready = threading.Event()

    def on_line(line: str) -> None:
        if line.startswith("PDSERVE "):
            event = json.loads(line[len("PDSERVE ") :])
            worker.address = event["address"]
            if event["event"] == "ready":
                ready.set()

    _pump(worker.proc, worker.log, on_line)
    return worker, ready


def wait_started(worker: Worker, ready: threading.Event, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        tail = "".join(worker.log[-30:])
        assert worker.proc.poll() is None, f"{worker.role} worker exited:\n{tail}"
        assert time.monotonic() < deadline, f"{worker.role} worker not ready:\n{tail}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, dict | str]:
    """GET url -> (status, JSON body or text); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except OSError:
        return 0, ""
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def end_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGCONT (a stopped process handles nothing), SIGTERM, then SIGKILL after grace."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class RouterProc:
    """`pdserve router` as a process on a fixed port (a restarted router takes the port
    of the one it replaces)."""

    def __init__(self, prefill: list[str], decode: list[str], *args: str, port: int = 0):
        self.port = port or free_port()
        cmd = [*PDSERVE, "router", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += [x for a in prefill for x in ("--prefill", a)]
        cmd += [x for a in decode for x in ("--decode", a)]
        # probes every 0.5 s: a dead worker is seen at once (a frozen one after the
        # router's default 3 probes in a row time out)
        cmd += ["--served-model-name", SERVED, "--health-interval", "0.5", *args]
        self.proc = spawn(cmd)
        self.ready_seen: list[tuple[int, dict | str]] = []  # /ready answers wait_ready saw
        self.log: list[str] = []
        _pump(self.proc, self.log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> tuple[int, dict | str]:
        return get(self.url + "/ready", timeout=2)

    def pairs(self) -> int:
        """Usable pairs by /ready (-1: no JSON answer)."""
        _, body = self.ready()
        return body.get("pairs", -1) if isinstance(body, dict) else -1

    def wait_ready(self, pairs: int, timeout: float = 60) -> dict:
        """Until /ready answers 200 with `pairs` usable pairs."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "router exited:\n" + "".join(self.log[-30:])
            status, body = self.ready()
            self.ready_seen.append((status, body))
            if status == 200 and body["pairs"] == pairs:
                return body
            assert time.monotonic() < deadline, (status, body, "".join(self.log[-30:]))
            time.sleep(0.1)

    def metric(self, name: str) -> float:
        """A counter's value from /metrics (0 when the series does not exist yet)."""
        status, text = get(self.url + "/metrics")
        assert status == 200, text
        for line in str(text).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        end_process(self.proc)


@dataclass
class Stack:
    """Workers started in parallel (env: extra environment per worker, args: extra
    flags), then a router over all of them. Always use it as a context manager."""

    model: str
    prefill: list[dict] = field(default_factory=lambda: [{}])  # each {"env":..., "args":...}
    decode: list[dict] = field(default_factory=lambda: [{}])
    router_args: tuple[str, ...] = ()
    prefills: list[Worker] = field(default_factory=list)
    decodes: list[Worker] = field(default_factory=list)
    routers: list[RouterProc] = field(default_factory=list)

    def __enter__(self) -> Stack:
        try:
            started = [
                spawn_worker("prefill", self.model, *p.get("args", ()), env=p.get("env"))
                for p in self.prefill
            ]
            self.prefills = [w for w, _ in started]
            more = [
                spawn_worker("decode", self.model, *d.get("args", ()), env=d.get("env"))
                for d in self.decode
            ]
            self.decodes = [w for w, _ in more]
            for worker, ready in started + more:
                wait_started(worker, ready)
            self.start_router()
            self.router.wait_ready(pairs=len(self.prefills) * len(self.decodes))
            note("stack up:", [f"{w.role} {w.address}" for w in self.workers])
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_router(
        self,
        port: int = 0,
        prefills: list[Worker] | None = None,
        decodes: list[Worker] | None = None,
    ) -> RouterProc:
        """A router over the given workers (default: all of the stack's)."""
        router = RouterProc(
            [w.address for w in (self.prefills if prefills is None else prefills)],
            [w.address for w in (self.decodes if decodes is None else decodes)],
            *self.router_args,
            port=port,
        )
        self.routers.append(router)
        return router

    def add_worker(self, role: str, *args: str, env: dict | None = None) -> Worker:
        """One more worker, ended with the stack."""
        worker, ready = spawn_worker(role, self.model, *args, env=env)
        (self.prefills if role == "prefill" else self.decodes).append(worker)
        wait_started(worker, ready)
        return worker

    @property
    def router(self) -> RouterProc:
        return self.routers[-1]

    @property
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    def __exit__(self, exc_type=None, exc=None, tb=None) -> None:
        # what each process said: for the failure report, or always with CHAOS_KEEP_LOGS=1
        if exc is not None or os.environ.get("CHAOS_KEEP_LOGS"):
            folder = tempfile.mkdtemp(prefix="pdserve-chaos-")
            logs = [(f"router-{r.port}", r.log) for r in self.routers]
            logs += [(f"{w.role}-{w.address.rpartition(':')[2]}", w.log) for w in self.workers]
            for name, lines in logs:
                with open(os.path.join(folder, name + ".log"), "w") as f:
                    f.writelines(lines)
                tail = "".join(lines[-40:]) if exc is not None else ""
                note(f"--- log of {name}: {folder}/{name}.log ---\n" + tail)
        for r in self.routers:
            r.stop()
        for w in self.workers:
            end_process(w.proc)
        note("stack down")


# --------------------------------------------------------------------------- load


@dataclass
class Outcome:
    """What one streamed request ended as: "ok" (finished), "sse_error" (an error event
    in the stream after it started), "http_error" (an OpenAI error answer before the
    stream started), "connection" (the connection broke), "cancelled" (we hung up)."""

    kind: str = ""
    text: str = ""
    chunks: int = 0  # chunks with text received
    finish_reason: str | None = None
    status: int | None = None  # http_error: the HTTP status
    error: dict | None = None  # sse_error / http_error: the OpenAI error object
    detail: str = ""
    first_token_s: float | None = None  # seconds from the request to its first text
    elapsed_s: float | None = None  # seconds from the request to its end


def client(url: str, timeout: float = 120) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)


async def stream_completion(
    c: openai.AsyncOpenAI,
    prompt: str,
    max_tokens: int,
    out: Outcome | None = None,
    on_chunk=None,
) -> Outcome:
    """One greedy streamed completion (ignore_eos: a fixed length). `out` is filled as
    the stream goes, so a caller that cancels the task still sees what arrived."""
    out = out if out is not None else Outcome()
    started = time.monotonic()
    try:
        stream = await c.completions.create(
            model=SERVED,
            prompt=prompt,
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async with stream:
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.text:
                    if out.first_token_s is None:
                        out.first_token_s = time.monotonic() - started
                    out.text += choice.text
                    out.chunks += 1
                    if on_chunk is not None:
                        on_chunk(out)
                if choice.finish_reason:
                    out.finish_reason = choice.finish_reason
        out.kind = "ok" if out.finish_reason else "connection"
        if not out.finish_reason:
            out.detail = "the stream ended without a finish reason"
    except asyncio.CancelledError:
        out.kind = "cancelled"
        out.elapsed_s = time.monotonic() - started
        raise
    except openai.APIStatusError as e:
        out.kind, out.status, out.error = "http_error", e.status_code, _error_object(e.body)
        out.detail = str(e)
    except openai.APIConnectionError as e:  # includes timeouts
        out.kind, out.detail = "connection", repr(e)
    except openai.APIError as e:  # an error event inside the stream
        out.kind, out.error, out.detail = "sse_error", _error_object(e.body), str(e)
    out.elapsed_s = time.monotonic() - started
    return out


def _error_object(body) -> dict | None:
    if isinstance(body, dict) and "error" in body and isinstance(body["error"], dict):
        body = body["error"]
    return body if isinstance(body, dict) else None


def assert_openai_error(err: dict | None) -> None:
    """An OpenAI error object: message, type, param, code."""
    assert isinstance(err, dict), err
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err


async def run_streams(url: str, prompts: list[str], max_tokens: int, timeout: float = 120):
    """All prompts streamed at once; returns their outcomes in order. Never hangs: the
    whole load has a deadline."""
    async with client(url, timeout) as c:
        return await asyncio.wait_for(
            asyncio.gather(*(stream_completion(c, p, max_tokens) for p in prompts)),
            timeout + 30,
        )


async def run_streams_with(url, texts, max_tokens, action, timeout: float = 120):
    """All prompts streamed at once while `action(outcomes)` (a coroutine function)
    does something to the stack; returns the outcomes once every stream has ended.
    The action sees the outcomes fill as the streams go. Never hangs: the action and
    the streams have deadlines, and every stream is cancelled on the way out."""
    outs = [Outcome() for _ in texts]
    async with client(url, timeout) as c:
        tasks = [
            asyncio.create_task(stream_completion(c, t, max_tokens, o)) for t, o in zip(texts, outs)
        ]
        try:
            await asyncio.wait_for(action(outs), timeout)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout + 30)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return outs


async def until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll a (blocking) predicate from a thread until it holds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(interval)


# --------------------------------------------------------------------- references

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite recipe for pancakes starts with",
    "In 1969, the first humans",
    "The quick brown fox",
    "A haiku about autumn:",
    "To install the package, run",
    "The most important rule of chess is",
    "Photosynthesis is the process by which",
    "List of prime numbers: 2, 3, 5,",
    "Dear customer, thank you for",
    "The mitochondria is",
    "Translate to French: good morning ->",
]


def prompts(n: int, tag: str = "", repeat: int = 1) -> list[str]:
    """n prompts, distinct from each other (a numbered prefix: no prefix-cache sharing
    between them). repeat: each prompt's text that many times (longer prompts, more
    KV blocks: ~12 tokens a time)."""
    return [
        f"{tag}#{i}. " + " ".join([PROMPTS[(i + k) % len(PROMPTS)] for k in range(repeat)])
        for i in range(n)
    ]


def references(colocated, texts: list[str], max_tokens: int) -> list[str]:
    """The colocated engine's greedy answers (ignore_eos, as the streams ask)."""
    import torch

    from services.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [o.output.text for o in colocated.generate(list(texts), params)]
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------- accounting


def assert_blocks_back(workers: list[Worker], timeout: float = 30.0) -> None:
    """Every worker's free KV blocks back to the total it started with, nothing
    running or waiting, and no orphaned block (services/engine/kv_audit.py)."""
    for w in workers:
        deadline = time.monotonic() + timeout
        while True:
            report = w.load()
            idle = report.num_running == 0 and report.num_waiting == 0
            if report.num_free_blocks == report.num_total_blocks and idle:
                break
            assert time.monotonic() < deadline, f"{w.role} {w.address} holds blocks: {report}"
            time.sleep(0.1)
        assert report.orphaned_kv_blocks == 0, f"{w.role} {w.address}: {report}"
        assert report.oldest_kv_reservation_seconds == 0, f"{w.role} {w.address}: {report}"


def count_log(worker: Worker, text: str) -> int:
    return sum(text in line for line in list(worker.log))


def wait_log_count(worker: Worker, text: str, count: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (n := count_log(worker, text)) < count:
        assert time.monotonic() < deadline, f"{n} of {count} {text!r} lines in {worker.role}"
        time.sleep(0.02)
    return n
