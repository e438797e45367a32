"""Latency the router adds: the same streaming requests sent to the router (HTTP + SSE)
and straight to the decode worker, over its unary-stream Generate and over the shared
GenerateStream the router itself uses, with one prefill and one decode worker on this
machine. Reports p50 / p99 time to first token and per relayed token.

    .venv/bin/python benchmarks/router_overhead.py --concurrency 1 64 512 [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import grpc

try:  # imported from the repository's root (tests)
    from benchmarks.router_cpu import tree_cpu_s
except ImportError:  # run as a script: benchmarks/ is the first path
    from router_cpu import tree_cpu_s  # type: ignore[no-redef]
from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.launcher import PDSERVE, Child
from router.mux import DecodeMux


def start_worker(
    role: str, *args: str, model: str, ready_timeout: float = 300, program=PDSERVE
) -> Child:
    """A worker process on a free port, ready to serve. One that exits, outlasts
    ready_timeout or is interrupted while starting (Ctrl-C, or SIGTERM from `timeout`:
    main() turns it into KeyboardInterrupt) is stopped, and its last output shown.
    program: the command line before the role (pdserve's, or a wrapper of it)."""
    cmd = [*program, role, "--model", model, "--port", "0", *args]
    started = time.monotonic()
    signals = _HeldSignals()  # until `worker` holds the process: then cleanup can reach it
    worker = None
    try:
        worker = Child(role, cmd, env={**os.environ, "GLOG_minloglevel": "2"}, echo=False)
        signals.release()
        while not worker.ready.wait(0.5):  # not the whole wait for one that already exited
            if worker.proc.poll() is not None or time.monotonic() - started > ready_timeout:
                break
        else:
            return worker
    except BaseException:  # interrupted: say where the start had got to, then unwind
        signals.release(deliver=False)
        if worker is not None:
            worker.stop(10)
            print(_not_ready(worker, started), file=sys.stderr, flush=True)
        raise
    worker.stop(10)
    raise RuntimeError(_not_ready(worker, started))


class _HeldSignals:
    """SIGINT and SIGTERM recorded, not acted on, until release(); then delivered to the
    handlers they had. (Not a blocked signal mask: a worker started meanwhile would
    inherit it and ignore SIGTERM.)"""

    SIGNUMS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.held: list[int] = []
        in_main = threading.current_thread() is threading.main_thread()  # signal.signal's rule
        self.previous = {s: signal.signal(s, self._record) for s in self.SIGNUMS if in_main}

    def _record(self, signum, frame):
        self.held.append(signum)

    def release(self, deliver: bool = True) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
        for signum in self.held if deliver else ():
            signal.raise_signal(signum)  # the restored handler runs here (it may raise)
        self.held = []


def wait_router_ready(url: str, router: subprocess.Popen, timeout: float = 60) -> None:
    """Until the router's /ready answers 200; a router that exits first ends the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise SystemExit(f"the router exited ({router.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the router at {url} was not ready in {timeout:.0f} s")


def _not_ready(worker: Child, started: float) -> str:
    return (
        f"the {worker.name} worker did not become ready in {time.monotonic() - started:.0f} s;"
        " its last output:\n" + "".join(worker.recent)
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")


SERVED_NAME = "smollm2-135m"  # the router's --served-model-name here


async def via_router(session, url, i, max_tokens, model=SERVED_NAME):
    body = {
        "model": model,
        "prompt": f"Request {i}: count from one to ten:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return start, stamps


async def via_grpc(stub, prefill_addr, i, max_tokens):
    req = decode_pb2.GenerateRequest(
        request_id=f"direct-{i}-{time.monotonic_ns()}",
        text=f"Request {i}: count from one to ten:",
        sampling_params=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        prefill_address=prefill_addr,
    )
    start = time.perf_counter()
    stamps = []
    async for resp in stub.Generate(req):
        if resp.token_ids:
            stamps.append(time.perf_counter())
    return start, stamps


async def via_mux(mux, prefill_addr, i, max_tokens):
    """The decode worker's GenerateStream, shared by every request, as the router
    calls it (router/mux.py): the router's own cost is the gap between this and the
    router path."""
    req = decode_pb2.GenerateRequest(
        request_id=f"mux-{i}-{time.monotonic_ns()}",
        text=f"Request {i}: count from one to ten:",
        sampling_params=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        prefill_address=prefill_addr,
    )
    start = time.perf_counter()
    stamps = []
    call = mux.open(req, 600)
    try:
        async for resp in call:
            if resp.token_ids:
                stamps.append(time.perf_counter())
    finally:
        call.cancel()
    return start, stamps


def summarize(results):
    ttft = [stamps[0] - start for start, stamps in results if stamps]
    itl = [b - a for _, stamps in results for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
    }


async def run_raw(
    url, decode_addr, prefill_addr, n, max_tokens, rounds=1, wave_start=None, model=SERVED_NAME
):
    """`rounds` waves of n concurrent requests, alternating router and direct gRPC so
    that drift on a shared machine hits both paths alike; each path's (start, token
    stamps) per request. `wave_start()`, if given, is called before every wave (the
    clients' barrier)."""
    paths = {"router": [], "direct gRPC": [], "direct GenerateStream": []}
    async with (
        aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
        ) as session,
        grpc.aio.insecure_channel(decode_addr) as ch,
    ):
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        mux = DecodeMux(stub)
        waves = {
            "router": lambda i: via_router(session, url, i, max_tokens, model),
            "direct gRPC": lambda i: via_grpc(stub, prefill_addr, i, max_tokens),
            "direct GenerateStream": lambda i: via_mux(mux, prefill_addr, i, max_tokens),
        }
        for _ in range(rounds):
            for name, one in waves.items():
                if wave_start is not None:
                    await asyncio.to_thread(wave_start)
                paths[name] += await asyncio.gather(*(one(i) for i in range(n)))
        await mux.close()
    return paths


async def run(url, decode_addr, prefill_addr, n, max_tokens, rounds=1):
    paths = await run_raw(url, decode_addr, prefill_addr, n, max_tokens, rounds)
    return {name: summarize(results) for name, results in paths.items()}


def _client_process(args: tuple, model: str, barrier, out) -> None:
    try:
        wave_start = lambda: barrier.wait(600)  # noqa: E731
        out.put(asyncio.run(run_raw(*args, wave_start=wave_start, model=model)))
    except BaseException as e:  # the parent reports it
        barrier.abort()
        out.put(RuntimeError(repr(e)))


def run_clients(url, decode_addr, prefill_addr, n, max_tokens, rounds, clients, model=SERVED_NAME):
    """run_raw()'s waves from `clients` processes at once, each with its share of the
    n streams, started together per wave, pooled per path: one Python client's own
    serial work per request (HTTP or gRPC) no longer queues a wave's requests."""
    clients = min(clients, n)
    shares = [n // clients + (i < n % clients) for i in range(clients)]
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_process,
            args=((url, decode_addr, prefill_addr, k, max_tokens, rounds), model, barrier, out),
        )
        for k in shares
    ]
    for p in procs:
        p.start()
    try:
        parts = [out.get(timeout=1200) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    if errors := [e for e in parts if isinstance(e, BaseException)]:
        raise RuntimeError(f"a client failed: {errors[0]}")
    return {name: [r for part in parts for r in part[name]] for name in parts[0]}


def main() -> None:
    from services.models.default_model import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="waves per concurrency (default: 64 at one stream, else ~512 requests and at "
        "least 2: a 64-stream wave's prefills batch differently each time)",
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=1,
        help="client processes sharing each wave's streams (pooled), so the client's own "
        "per-request work does not queue the wave",
    )
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument(
        "--model",
        default=None,
        help="model folder (default: the bundled model); e.g. a benchmarks/dummy_model.py "
        "folder of a tiny config with --load-format dummy, to see the host path alone",
    )
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu", help="both workers' device (e.g. cuda:0)")
    ap.add_argument("--api-server-count", type=int, default=1, help="the router's processes")
    ap.add_argument(
        "--ready-timeout", type=float, default=300, help="seconds a worker may take to start"
    )
    ap.add_argument(
        "--worker-args",
        default="",
        help="more worker flags, one string (e.g. '--kernel-backend triton')",
    )
    args = ap.parse_args()
    # SIGTERM (`timeout`, a job runner) unwinds like Ctrl-C: the workers, in sessions of
    # their own, would otherwise outlive this process and hold the GPU.
    signal.signal(signal.SIGTERM, _interrupt)
    model = args.model or str(default_model_dir())
    seqs = str(max(args.concurrency))
    common = ("--max-num-seqs", seqs, "--load-format", args.load_format, "--device", args.device)
    common += tuple(args.worker_args.split())
    workers: list[Child] = []  # stopped on the way out, however that comes
    try:
        measure(args, model, common, workers)
    finally:
        for w in workers:
            w.stop(30)


def measure(args, model: str, common: tuple[str, ...], workers: list[Child]) -> None:
    wait = args.ready_timeout
    prefill = start_worker("prefill", *common, model=model, ready_timeout=wait)
    workers.append(prefill)
    decode = start_worker(
        "decode", *common, "--num-kv-blocks", "8192", model=model, ready_timeout=wait
    )
    workers.append(decode)
    router = subprocess.Popen(
        [
            *PDSERVE,
            "router",
            "--port",
            str(args.port),
            "--prefill",
            prefill.address,
            "--decode",
            decode.address,
            "--served-model-name",
            SERVED_NAME,
            "--max-concurrent-requests",
            "0",
            "--api-server-count",
            str(args.api_server_count),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_router_ready(url, router)
        asyncio.run(run(url, decode.address, prefill.address, 2, args.max_tokens))  # warm-up
        print("| streams | path | TTFT p50 | TTFT p99 | per token p50 | per token p99 |")
        print("|---|---|---|---|---|---|")
        for n in args.concurrency:
            rounds = args.rounds or (64 if n == 1 else max(2, 512 // n))
            cpu0, _ = tree_cpu_s(router.pid)
            if args.clients > 1:
                raw = run_clients(
                    url, decode.address, prefill.address, n, args.max_tokens, rounds, args.clients
                )
                paths = {name: summarize(results) for name, results in raw.items()}
            else:
                paths = asyncio.run(
                    run(url, decode.address, prefill.address, n, args.max_tokens, rounds)
                )
            for name, r in paths.items():
                print(
                    f"| {n} | {name} | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms "
                    f"| {r['itl_p50_ms']:.1f} ms | {r['itl_p99_ms']:.1f} ms |",
                    flush=True,
                )
            cpu1, procs = tree_cpu_s(router.pid)
            # only the router path's requests reach the router
            per_request_ms = (cpu1 - cpu0) / (n * rounds) * 1e3
            print(
                f"router CPU at {n} streams: {per_request_ms:.3f} ms a request ({procs} processes)"
            )
            print(json.dumps({"streams": n, **paths}), file=sys.stderr)
    finally:
        router.terminate()
        router.wait(30)


if __name__ == "__main__":
    main()
