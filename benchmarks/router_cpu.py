"""A running router's CPU time per request, measured from /proc over bursts of streamed
one-token completions sent together, with the client's own CPU time and the bursts'
TTFT median. The router must run on this machine (its pid is read from /proc); with
`--api-server-count` N > 1 its server processes are counted with it.

    pdserve router --port 8190 --prefill 127.0.0.1:50160 --decode 127.0.0.1:50161 &
    python benchmarks/router_cpu.py --url http://127.0.0.1:8190 --pid $! --bursts 20 --burst 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import aiohttp


def tree_cpu_s(pid: int) -> tuple[float, int]:
    """CPU seconds a process and its live descendants (a router's API server
    processes) have run, and how many processes that is: the sum of their live
    threads' run time in nanoseconds (/proc/<pid>/task/<tid>/schedstat), where
    /proc/<pid>/stat counts whole clock ticks (10 ms), too coarse for a few hundred
    requests."""
    total_ns, count, stack = 0, 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total_ns += int(f.read().split()[0])
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # it exited meanwhile
            continue
        count += 1
    return total_ns / 1e9, count


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int) -> float:
    body = {
        "model": model,
        "prompt": f"Request {i}: count from one to ten:",
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start, first = time.perf_counter(), None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("a stream ended without an event")
    return first - start


async def run(url: str, pid: int, bursts: int, burst: int) -> dict:
    url = url.rstrip("/").removesuffix("/v1")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        await asyncio.gather(*(_one(session, url, model, i) for i in range(burst)))  # warm
        router0, client0 = tree_cpu_s(pid)[0], time.process_time()
        ttft: list[float] = []
        for _ in range(bursts):
            ttft += await asyncio.gather(*(_one(session, url, model, i) for i in range(burst)))
        router1, client1 = tree_cpu_s(pid)[0], time.process_time()
    n = bursts * burst
    ttft.sort()
    return {
        "requests": n,
        "router_cpu_ms_per_request": (router1 - router0) / n * 1e3,
        "client_cpu_ms_per_request": (client1 - client0) / n * 1e3,
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the router's base URL")
    ap.add_argument("--pid", type=int, required=True, help="the router's (main) process pid")
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--burst", type=int, default=64, help="requests sent together")
    args = ap.parse_args()
    s = asyncio.run(run(args.url, args.pid, args.bursts, args.burst))
    print(
        f"{s['requests']} requests: router CPU {s['router_cpu_ms_per_request']:.3f} ms per "
        f"request, client {s['client_cpu_ms_per_request']:.3f} ms; "
        f"TTFT p50 {s['ttft_p50_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
