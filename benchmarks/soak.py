"""Soak: mixed load through `pdserve up` for a long time, then the accounting.

Starts `pdserve up` (router + workers as processes), then keeps --concurrency clients
busy for --duration seconds with a seeded mix of work: streams read to the end, streams
cancelled at a random moment (the client closes the connection), non-streamed chat,
prompts sharing a prefix (the prefix cache), and bad requests that must be a 4xx.
Reports every process's resident memory and every worker's free KV blocks at the start
and the end, orphaned blocks (must be 0), and the outcomes by kind. Exits 1 when blocks
stay held, a block is orphaned, or any answer is an unexpected error (a 5xx, a broken
stream, a 4xx for a valid request).

    python benchmarks/soak.py --duration 1800 --concurrency 16 --prefill 1 --decode 1
    python benchmarks/soak.py --duration 60 --model /tmp/tiny -- --load-format dummy
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp

_METRIC = re.compile(r"^pdserve_router_worker_(\w+)\{([^}]*)\} (\S+)$")
_BAD_BODIES = [  # each must be a 4xx with OpenAI's error shape
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "temperature": "hot"},
    {"messages": [{"role": {}}]},
    {"prompt": "hi", "stop": ["x"] * 100_000},
    {"prompt": "hi \ud800"},
    {"prompt": "hi", "n": 10**9},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mb(pids: list[int]) -> dict[str, float]:
    out = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{p}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
        role = next(
            (c.decode() for c in cmd if c in (b"router", b"prefill", b"decode", b"up")), "?"
        )
        out[f"{role}:{p}"] = round(rss / 1024, 1)
    return out


async def worker_gauges(session, url) -> dict[str, dict[str, float]]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    gauges: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            name, labels, value = m.groups()
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            gauges[f"{label['role']}@{label['address']}"][name] = float(value)
    return gauges


class Load:
    def __init__(self, url: str, model: str, seed: int):
        self.url, self.model = url, model
        self.rng = random.Random(seed)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.prefix = " ".join(f"shared{i}" for i in range(40))

    async def one(self, session) -> None:
        r = self.rng.random()
        try:
            if r < 0.10:
                await self._bad(session)
            elif r < 0.30:
                await self._stream(session, cancel_after=self.rng.uniform(0.0, 2.0))
            elif r < 0.40:
                await self._chat(session)
            else:
                await self._stream(session, cancel_after=None)
        except (TimeoutError, aiohttp.ClientError) as e:
            self.outcomes[f"error: {type(e).__name__}"] += 1

    def _prompt(self) -> str:
        words = " ".join(f"w{self.rng.randrange(1000)}" for _ in range(self.rng.randint(4, 60)))
        return f"{self.prefix} {words}" if self.rng.random() < 0.5 else words

    async def _stream(self, session, cancel_after: float | None) -> None:
        body = {
            "model": self.model,
            "prompt": self._prompt(),
            "max_tokens": self.rng.randint(1, 64),
            "temperature": self.rng.choice([0.0, 0.8]),
            "stream": True,
        }
        start = time.monotonic()
        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                self.outcomes[f"error: stream status {resp.status}"] += 1
                return
            async for line in resp.content:
                if cancel_after is not None and time.monotonic() - start > cancel_after:
                    self.outcomes["cancelled"] += 1
                    return  # leaving the block closes the connection
                if line.startswith(b"data: ") and b'"error"' in line:
                    self.outcomes["error: SSE error event"] += 1
                    return
                if line.strip() == b"data: [DONE]":
                    self.outcomes["stream ok"] += 1
                    return
        self.outcomes["error: stream ended without [DONE]"] += 1

    async def _chat(self, session) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self._prompt()}],
            "max_tokens": self.rng.randint(1, 32),
        }
        async with session.post(f"{self.url}/v1/chat/completions", json=body) as resp:
            data = await resp.json(content_type=None)
            ok = resp.status == 200 and data["choices"][0]["message"] is not None
            self.outcomes["chat ok" if ok else f"error: chat status {resp.status}"] += 1

    async def _bad(self, session) -> None:
        body = {"model": self.model, **self.rng.choice(_BAD_BODIES)}
        payload = json.dumps(body).encode()  # a lone surrogate travels escaped
        headers = {"Content-Type": "application/json"}
        async with session.post(f"{self.url}/v1/completions", data=payload, headers=headers) as r:
            data = await r.json(content_type=None)
            shaped = isinstance(data, dict) and "message" in data.get("error", {})
            ok = 400 <= r.status < 500 and shaped
            self.outcomes["bad input refused" if ok else f"error: bad input got {r.status}"] += 1


async def soak(url: str, args, pids) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        start_blocks = await worker_gauges(session, url)
        start_rss = rss_mb(pids())
        load = Load(url, model, args.seed)
        deadline = time.monotonic() + args.duration
        next_report = time.monotonic() + args.report_every

        async def client():
            nonlocal next_report
            while time.monotonic() < deadline:
                await load.one(session)
                if time.monotonic() >= next_report:
                    next_report += args.report_every
                    elapsed = args.duration - (deadline - time.monotonic())
                    total_rss = sum(rss_mb(pids()).values())
                    print(
                        f"{elapsed:7.0f}s  {dict(load.outcomes)}  rss {total_rss:.0f} MB",
                        flush=True,
                    )

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        # the last cancellations free their blocks within a second or two
        settle = time.monotonic() + 10
        while True:
            end_blocks = await worker_gauges(session, url)
            idle = all(g["num_free_blocks"] == g["num_total_blocks"] for g in end_blocks.values())
            if idle or time.monotonic() > settle:
                break
            await asyncio.sleep(0.5)
        end_rss = rss_mb(pids())
    return {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "outcomes": dict(load.outcomes),
        "rss_mb": {"start": start_rss, "end": end_rss},
        "workers": {
            name: {
                "free_blocks_start": start_blocks[name].get("num_free_blocks"),
                "free_blocks_end": g["num_free_blocks"],
                "total_blocks": g["num_total_blocks"],
                "orphaned_kv_blocks": g["orphaned_kv_blocks"],
                "kv_transfers_failed": g.get("kv_transfers_failed", 0),
            }
            for name, g in end_blocks.items()
        },
    }


def verdict(report: dict) -> list[str]:
    problems = [f"{c} x {k}" for k, c in report["outcomes"].items() if k.startswith("error")]
    for name, w in report["workers"].items():
        if w["free_blocks_end"] != w["total_blocks"]:
            problems.append(f"{name}: {w['total_blocks'] - w['free_blocks_end']} blocks held")
        if w["orphaned_kv_blocks"]:
            problems.append(f"{name}: {w['orphaned_kv_blocks']} orphaned blocks")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: pdserve up's default model")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--report-every", type=float, default=60.0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--stack-log", default="soak-stack.log", help="pdserve up's output")
    ap.add_argument("worker_args", nargs="*", help="after --: flags for every worker")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port)]
    cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    if args.model:
        cmd += ["--model", args.model]
    if args.worker_args:
        cmd += ["--", *args.worker_args]
    stack_log = open(args.stack_log, "w")  # noqa: SIM115 (open while the stack runs)
    up = subprocess.Popen(cmd, stdout=stack_log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"pdserve up on {url}, its output in {args.stack_log}", flush=True)
    try:
        deadline = time.monotonic() + 600
        while not _ready(url):
            if up.poll() is not None or time.monotonic() > deadline:
                print("pdserve up did not become ready", file=sys.stderr)
                return 1
            time.sleep(1)
        report = asyncio.run(soak(url, args, lambda: descendants(up.pid)))
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        stack_log.close()
    problems = verdict(report)
    report["problems"] = problems
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if problems else 0


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
