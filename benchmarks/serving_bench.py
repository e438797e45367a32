"""Online serving benchmark: streamed completions through the router's OpenAI endpoint,
reporting time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL, between streamed chunks), end-to-end latency and throughput,
as vLLM's and SGLang's serving benchmarks do.

Prompts are random token ids, each request its own unless --shared-prefix-len gives
them a common start (the prefix cache and prefix_aware routing then help; the cached
prompt tokens are reported). Answers run to exactly --output-len tokens (ignore_eos).
Requests start at --request-rate per second (Poisson arrivals; inf: all at once), at
most --max-concurrency in flight. When the server is pdserve's router, the means of its
own histograms over the run split TTFT into queueing, prefill and KV transfer (they
count every client's requests, so run the benchmark alone).

    python benchmarks/serving_bench.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 200 --input-len 1024 --output-len 128 --max-concurrency 16

At hundreds of streams one Python client parsing every event becomes the bottleneck
it measures: --clients N splits the prompts and the concurrency over N processes that
start together, and the summary pools their requests (percentiles over all of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from send to the first chunk with text
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


async def _one_request(
    session: aiohttp.ClientSession, url: str, payload: dict, headers: dict
) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft > 0 and res.output_tokens > 0
        if not res.ok:
            res.error = "stream ended without text or usage"
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean / median / p90 / p99 in milliseconds (nearest-rank percentiles), and how
    many values they summarize."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan, "n": 0}
    s = sorted(values)

    def rank(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {
        "mean": statistics.fmean(s) * scale,
        "median": statistics.median(s) * scale,
        "p90": rank(90) * scale,
        "p99": rank(99) * scale,
        "n": len(s),
    }


# pdserve router histograms whose means split a request's time on the server
_SERVER_HISTOGRAMS = ("time_to_first_token", "queue_time", "prefill_time", "kv_transfer_time")


def _server_root(base_url: str) -> str:
    """The server's root URL, whether given with or without the OpenAI /v1 suffix."""
    return base_url.rstrip("/").removesuffix("/v1")


async def server_histograms(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """(sum, count) of the router's histograms, or None when the server has no such
    /metrics (not pdserve's router)."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("pdserve_router_") and name.endswith(("_seconds_sum", "_seconds_count")):
            values[name] = float(value)
    found = {}
    for h in _SERVER_HISTOGRAMS:
        base = f"pdserve_router_{h}_seconds"
        if f"{base}_count" in values:
            found[h] = (values[f"{base}_sum"], values[f"{base}_count"])
    return found or None


def _server_means(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Mean milliseconds per histogram between two scrapes (None: not available)."""
    if before is None or after is None:
        return None
    means = {}
    for h, (total, count) in after.items():
        total0, count0 = before.get(h, (0.0, 0.0))
        if count > count0:
            means[f"{h}_ms"] = (total - total0) / (count - count0) * 1e3
    return means


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_benchmark(base_url: str, **kwargs) -> dict:
    """Send `warmup` uncounted requests one by one (first-request costs: kernel
    compilation, connections), then the measured ones; return the summary (latencies in
    ms) plus per-request results under "requests". kwargs: _measure's."""
    return summarize(*await _measure(base_url, **kwargs))


async def _measure(
    base_url: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    model: str | None = None,
    token_range: tuple[int, int] = (100, 10000),
    shared_prefix_len: int = 0,
    seed: int = 0,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    warmup: int = 1,
    ready=None,
) -> tuple:
    """(results, duration, router metrics before and after, the run's parameters).
    `ready`: awaited between the warm-up and the measured requests (run_clients' start
    line)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    if not request_rate > 0:
        raise ValueError("request_rate must be > 0 (inf: all at once)")
    base_url = _server_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if warmup < 0:
        raise ValueError("warmup must be >= 0")
    if not 0 <= shared_prefix_len <= input_len:
        raise ValueError("shared_prefix_len must be in [0, input_len]")
    rng = random.Random(seed)
    prefix = [rng.randrange(*token_range) for _ in range(shared_prefix_len)]
    prompts = [
        prefix + [rng.randrange(*token_range) for _ in range(input_len - shared_prefix_len)]
        for _ in range(warmup + num_prompts)
    ]
    warmup_prompts, prompts = prompts[:warmup], prompts[warmup:]
    gaps = [
        0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)
        for _ in range(num_prompts)
    ]
    limit = asyncio.Semaphore(max_concurrency or num_prompts)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = model or await first_model(session, base_url, headers)
        url = f"{base_url}/v1/completions"

        async def send(prompt: list[int]) -> RequestResult:
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with limit:
                return await _one_request(session, url, payload, headers)

        for prompt in warmup_prompts:
            res = await send(prompt)
            if not res.ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")

        if ready is not None:
            await ready()
        metrics_before = await server_histograms(session, base_url)
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        metrics_after = await server_histograms(session, base_url)
    meta = dict(
        model=model,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        shared_prefix_len=shared_prefix_len,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
    )
    return results, duration, metrics_before, metrics_after, meta


def summarize(results, duration, metrics_before, metrics_after, meta: dict) -> dict:
    """The summary of one run's RequestResults (those of several clients pooled)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    return {
        **meta,
        "completed": len(done),
        "failed": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _percentiles([r.ttft for r in done]),
        "tpot_ms": _percentiles(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
        ),
        "itl_ms": _percentiles([x for r in done for x in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in done]),
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "server_ms": _server_means(metrics_before, metrics_after),
        "requests": [asdict(r) | {"itl": len(r.itl)} for r in results],
    }


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _client_process(base_url: str, kwargs: dict, barrier, out) -> None:
    def start_line() -> None:
        barrier.wait()  # every client warmed up: the parent reads the router's metrics
        barrier.wait()  # and lets all of them go at once

    async def ready() -> None:
        await asyncio.to_thread(start_line)

    try:
        results, _, _, _, meta = asyncio.run(_measure(base_url, ready=ready, **kwargs))
        out.put((meta, [asdict(r) for r in results], time.time()))
    except BaseException as e:  # the parent reports it rather than waiting forever
        barrier.abort()
        out.put(e)
        raise


def run_clients(base_url: str, *, clients: int, num_prompts: int, max_concurrency=None, **kw):
    """run_benchmark's measurement over `clients` processes started together (each
    with its share of the prompts and of the concurrency, and its own seed), pooled."""
    if clients < 1 or clients > num_prompts:
        raise ValueError("clients must be in [1, num_prompts]")
    if max_concurrency is not None and max_concurrency < clients:
        raise ValueError("max_concurrency must be at least clients")
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(clients + 1), ctx.Queue()
    conc = _shares(max_concurrency, clients) if max_concurrency else [None] * clients
    seed, rate = kw.pop("seed", 0), kw.pop("request_rate", math.inf)
    share = dict(kw, request_rate=rate / clients)  # Poisson arrivals add up to `rate`
    procs = [
        ctx.Process(
            target=_client_process,
            args=(
                base_url,
                share | dict(num_prompts=n, max_concurrency=c, seed=seed + i),
                barrier,
                out,
            ),
        )
        for i, (n, c) in enumerate(zip(_shares(num_prompts, clients), conc))
    ]
    for p in procs:
        p.start()
    try:
        timeout = kw.get("timeout_s", 600.0)
        barrier.wait(timeout)
        session_metrics = asyncio.run(_histograms(base_url))
        start = time.time()
        barrier.wait(timeout)
        parts = [out.get(timeout=timeout * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    if errors := [e for e in parts if isinstance(e, BaseException)]:
        raise RuntimeError(f"a client failed: {errors[0]!r}")
    results = [RequestResult(**r) for _, rs, _ in parts for r in rs]
    duration = max(end for _, _, end in parts) - start
    # a client's parameters, with the whole run's counts
    meta = parts[0][0] | dict(
        num_prompts=num_prompts, max_concurrency=max_concurrency, request_rate=rate, clients=clients
    )
    after = asyncio.run(_histograms(base_url))
    return summarize(results, duration, session_metrics, after, meta)


async def _histograms(base_url: str) -> dict | None:
    async with aiohttp.ClientSession() as session:
        return await server_histograms(session, _server_root(base_url))


def format_summary(s: dict) -> str:
    lines = [
        f"model {s['model']}: {s['num_prompts']} requests of {s['input_len']} -> "
        f"{s['output_len']} tokens, concurrency {s['max_concurrency'] or 'unlimited'}, "
        f"rate {s['request_rate']}/s",
        f"completed {s['completed']}, failed {s['failed']}"
        + (f" (first error: {s['first_error']})" if s["failed"] else ""),
        f"duration {s['duration_s']:.2f} s; {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        p = s[key]
        lines.append(
            f"{name:5s} ms  mean {p['mean']:9.2f}  median {p['median']:9.2f}  "
            f"p90 {p['p90']:9.2f}  p99 {p['p99']:9.2f}"
        )
    if s["shared_prefix_len"]:
        prompt_tokens = s["completed"] * s["input_len"]
        lines.append(f"cached prompt tokens {s['cached_prompt_tokens']} of {prompt_tokens}")
    if s["server_ms"]:
        lines.append(
            "router means ms  "
            + "  ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in s["server_ms"].items())
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument(
        "--token-range",
        default="100,10000",
        help="prompt token ids are drawn from [lo, hi) (must be valid for the model)",
    )
    ap.add_argument(
        "--shared-prefix-len", type=int, default=0, help="leading tokens every prompt shares"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--clients", type=int, default=1, help="client processes sharing the load (pooled)"
    )
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.token_range.split(","))
    kwargs = dict(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        model=args.model,
        token_range=(lo, hi),
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
        api_key=args.api_key,
        timeout_s=args.timeout,
        warmup=args.warmup,
    )
    if args.clients > 1:
        summary = run_clients(args.base_url, clients=args.clients, **kwargs)
    else:
        summary = asyncio.run(run_benchmark(args.base_url, **kwargs))
    print(format_summary(summary), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
