"""The decode worker's host path at high concurrency: N streams straight to a decode
worker (it prefills itself), each generating --tokens tokens, either on one shared
GenerateStream (the router's way, --path stream) or a Generate call each; prints
output tokens/s and the inter-token latency seen by the clients. With a tiny model
(benchmarks/dummy_model.py, --load-format dummy) the model step is small and what is
left is the Python per stream per step: output hand-off, detokenization, protobuf,
gRPC.

    python benchmarks/dummy_model.py --config benchmarks/configs/tiny-llama.json --out /tmp/tiny
    python -m benchmarks.grpc_streams_bench --model /tmp/tiny --load-format dummy \\
        --streams 16 256 512 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

try:  # imported from the repository's root (tests)
    from benchmarks.router_overhead import pct, start_worker
except ImportError:  # run as a script: benchmarks/ is the first path
    from router_overhead import pct, start_worker  # type: ignore[no-redef]
from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from router.mux import DecodeMux


def _request(i: int, tokens: int) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=f"bench-{i}-{time.monotonic_ns()}",
        token_ids=common_pb2.TokenIds(ids=[5 + i % 100] * 8),
        sampling_params=common_pb2.SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True
        ),
    )


async def _stream(stub, mux, i: int, tokens: int, gaps: list[float]) -> int:
    req = _request(i, tokens)
    call = mux.open(req, 600) if mux is not None else stub.Generate(req)
    last, count = None, 0
    async for resp in call:
        now = time.perf_counter()
        count += len(resp.token_ids)
        if last is not None:
            gaps.append(now - last)
        last = now
    if mux is not None:
        call.cancel()
    return count


async def run(address: str, streams: int, tokens: int, shared: bool) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        mux = DecodeMux(stub) if shared else None
        gaps: list[float] = []
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(_stream(stub, mux, i, tokens, gaps) for i in range(streams))
        )
        elapsed = time.perf_counter() - start
        if mux is not None:
            await mux.close()
    return {
        "path": "GenerateStream (shared)" if shared else "Generate (one call each)",
        "streams": streams,
        "output_tok_s": round(sum(counts) / elapsed),
        "itl_p50_ms": round(pct(gaps, 0.5), 2),
        "itl_p99_ms": round(pct(gaps, 0.99), 2),
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 256, 512])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--worker-args",
        default="",
        help='more flags for the decode worker, e.g. "--kernel-backend triton '
        '--max-cudagraph-capture-size 512"',
    )
    ap.add_argument(
        "--path",
        choices=["stream", "unary", "both"],
        default="both",
        help="stream: every request on one GenerateStream (the router's way); unary: a "
        "Generate call per request",
    )
    args = ap.parse_args()
    paths = {"stream": [True], "unary": [False], "both": [False, True]}[args.path]
    most = str(max(args.streams))
    worker = start_worker(
        "decode",
        *("--load-format", args.load_format, "--device", args.device),
        *("--max-num-seqs", most, "--num-kv-blocks", str(64 * int(most)), "--skip-warmup"),
        *args.worker_args.split(),
        model=args.model,
    )
    try:
        asyncio.run(run(worker.address, 4, 8, False))  # warm-up
        asyncio.run(run(worker.address, 4, 8, True))
        print("| path | streams | output tok/s | ITL p50 | ITL p99 |")
        print("|---|---|---|---|---|")
        for n in args.streams:
            for shared in paths:
                r = asyncio.run(run(worker.address, n, args.tokens, shared))
                print(
                    f"| {r['path']} | {n} | {r['output_tok_s']} | {r['itl_p50_ms']} ms "
                    f"| {r['itl_p99_ms']} ms |",
                    flush=True,
                )
                print(json.dumps(r), flush=True)
    finally:
        worker.stop(30)


if __name__ == "__main__":
    main()
