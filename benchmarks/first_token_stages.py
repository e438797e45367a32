"""Where the router's first token goes at one stream: the same streamed completions
sent one at a time through the router and straight to the decode worker's
GenerateStream, in turns, with time stamps along the path in the router and the decode
worker (time.perf_counter: CLOCK_MONOTONIC on Linux, one clock for every process on
the machine). Prints each stage's median per request, from the client's send.

    .venv/bin/python benchmarks/first_token_stages.py --model /tmp/tiny --load-format dummy
        [--requests 96] [--max-tokens 16] [--device cpu]

The stamps come from wrappers put around the router's and the worker's own functions
in their processes (this file started as `--as router|worker`); a renamed function
makes the wrapper fail loudly, not measure nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time

STAMPS_ENV = "PDSERVE_FIRST_TOKEN_STAMPS"  # the file a stamped process writes
_stamps: dict[str, dict[str, float]] = {}


def _stamp(rid, name: str) -> None:
    if rid:
        _stamps.setdefault(rid, {}).setdefault(name, time.perf_counter())


def _dump() -> None:
    """Written whole, then renamed: a process stopped mid-write leaves the last dump."""
    path = os.environ[STAMPS_ENV]
    snapshot = {rid: dict(entry) for rid, entry in list(_stamps.items())}  # others stamp on
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(snapshot, f)
    os.replace(f.name, path)


def _wrap(owner, name: str, rid_of, before: str, after: str | None = None) -> None:
    """Stamp `before` as owner.name starts (and `after` once it returns or its
    awaitable ends), for the request rid_of(*args) names."""
    import inspect

    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        async def wrapped(*args, **kwargs):
            rid = rid_of(*args)
            _stamp(rid, before)
            try:
                return await fn(*args, **kwargs)
            finally:
                if after:
                    _stamp(rid, after)
    else:

        def wrapped(*args, **kwargs):
            _stamp(rid_of(*args), before)
            return fn(*args, **kwargs)

    setattr(owner, name, wrapped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router_overhead():
    try:  # imported from the repository's root (tests)
        from benchmarks import router_overhead
    except ImportError:  # run as a script: benchmarks/ is the first path
        import router_overhead  # type: ignore[no-redef]
    return router_overhead


def _start_id(message) -> str | None:
    return message.start.request_id if message.HasField("start") else None


def run_router(argv: list[str]) -> None:
    import grpc.aio._call as grpc_call

    from router import dispatch, mux, routes, sse
    from router.cli import main

    _wrap(routes, "_generate", lambda request, parse: request.headers.get("X-Request-Id"),
          "router: handler")  # fmt: skip
    _wrap(dispatch.GenerationRun, "_attempt", lambda run, *a: run.request_id, "router: dispatched")
    _wrap(mux.DecodeMux, "open", lambda m, gen, t: gen.request_id, "router: stream open")
    _wrap(grpc_call._StreamRequestMixin, "_write", lambda call, msg: _start_id(msg),
          "router: gRPC write", "router: gRPC write done")  # fmt: skip
    _wrap(mux.MuxedRequest, "deliver", lambda r, item: r._rid, "router: first response")
    _wrap(sse.EventStream, "prepare", lambda r, req: r.headers.get("X-Request-Id"),
          "router: SSE headers")  # fmt: skip
    _wrap(sse.EventStream, "write", lambda r, data: r.headers.get("X-Request-Id"),
          "router: SSE write")  # fmt: skip
    atexit.register(_dump)
    sys.exit(main(argv))


def run_worker(argv: list[str]) -> None:
    from pdserve.cli import main
    from services.decode import mux

    _wrap(mux.MuxSession, "_start", lambda s, start, t: start.request_id, "worker: start")
    _wrap(mux.Outbox, "response", lambda box, rid, *a, **k: rid, "worker: first response")
    take = mux.Outbox.take

    def taken(box):  # the message that carries a first response goes out now
        now = time.perf_counter()
        for entry in list(_stamps.values()):
            if "worker: first response" in entry:
                entry.setdefault("worker: sent", now)
        return take(box)

    mux.Outbox.take = taken

    def dump_every_second() -> None:  # the worker may end by a signal, not atexit
        while True:
            time.sleep(1)
            _dump()

    threading.Thread(target=dump_every_second, daemon=True).start()
    sys.exit(main(argv))


async def _requests(url: str, decode_address: str, prefill_address: str, n: int, max_tokens: int):
    import aiohttp
    import grpc

    via_mux = _router_overhead().via_mux
    from pdpb.v1 import decode_pb2_grpc
    from router.mux import DecodeMux

    routed, direct = {}, []
    channel = grpc.aio.insecure_channel(decode_address)
    stream = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            rid = f"stages-{i}"
            body = {"model": "m", "prompt": f"Request {i}: count from one to ten:",
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            sent, first = time.perf_counter(), None
            async with session.post(
                f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter()
            routed[rid] = {"client: sent": sent, "client: first token": first}
            start, stamps = await via_mux(stream, prefill_address, i, max_tokens)
            direct.append({"client: sent": start, "client: first token": stamps[0]})
    await stream.close()
    await channel.close()
    return routed, direct


def _medians(rows: list[dict[str, float]], title: str) -> None:
    """Each stamp's median offset from the client's send, in path order."""
    medians = {}
    for name in {k for r in rows for k in r} - {"client: sent"}:
        offsets = sorted(r[name] - r["client: sent"] for r in rows if name in r)
        medians[name] = offsets[len(offsets) // 2] * 1e3
    print(f"| {title} | ms after the client's send (p50) |\n|---|---|")
    for name, ms in sorted(medians.items(), key=lambda item: item[1]):
        print(f"| {name} | {ms:.3f} |")


def main() -> None:
    if sys.argv[1:2] == ["--as"]:
        role, argv = sys.argv[2], sys.argv[3:]
        return run_router(argv) if role == "router" else run_worker(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=18741, help="the router's (0: a free one)")
    ap.add_argument("--worker-args", default="", help="more worker flags, one string")
    ap.add_argument("--ready-timeout", type=float, default=300)
    args = ap.parse_args()
    bench = _router_overhead()
    from pdserve.launcher import PDSERVE

    port = args.port or _free_port()
    tmp = tempfile.mkdtemp()
    files = {"router": f"{tmp}/router.json", "worker": f"{tmp}/worker.json"}
    stamped = [sys.executable, os.path.abspath(__file__), "--as"]
    common = ("--load-format", args.load_format, "--device", args.device,
              *shlex.split(args.worker_args))  # fmt: skip
    os.environ[STAMPS_ENV] = files["worker"]
    workers, router = [], None
    try:
        workers.append(
            bench.start_worker(
                "prefill",
                *common,
                model=args.model,
                program=PDSERVE,
                ready_timeout=args.ready_timeout,
            )
        )
        prefill = workers[-1]
        workers.append(
            bench.start_worker(
                "decode",
                *common,
                model=args.model,
                program=[*stamped, "worker"],
                ready_timeout=args.ready_timeout,
            )
        )
        decode = workers[-1]
        router = subprocess.Popen(
            [*stamped, "router", "--port", str(port), "--prefill", prefill.address,
             "--decode", decode.address, "--served-model-name", "m",
             "--max-concurrent-requests", "0", "--log-level", "WARNING"],
            env={**os.environ, STAMPS_ENV: files["router"]},
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        bench.wait_router_ready(url, router)
        warm = 4  # the first requests of each path compile and connect
        routed, direct = asyncio.run(
            _requests(url, decode.address, prefill.address, args.requests + warm, args.max_tokens)
        )
        time.sleep(1.5)  # the worker's last dump
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for w in reversed(workers):
            w.stop(10)
    router_stamps = json.load(open(files["router"]))
    worker_stamps = json.load(open(files["worker"]))
    rows = [
        {**stamps, **router_stamps.get(rid, {}), **worker_stamps.get(rid, {})}
        for rid, stamps in list(routed.items())[warm:]
    ]
    # the direct requests' worker ids are via_mux's ("mux-<i>-<ns>"), in request order
    mux_ids = sorted(
        (k for k in worker_stamps if k.startswith("mux-")),
        key=lambda k: worker_stamps[k]["worker: start"],
    )
    rows_direct = [{**d, **worker_stamps[k]} for d, k in list(zip(direct, mux_ids))[warm:]]
    _medians(rows, "through the router")
    print()
    _medians(rows_direct, "straight to GenerateStream")


if __name__ == "__main__":
    main()
