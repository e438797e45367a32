"""Decode step times of several models, kernel backends and environment switches, each
run in its own process and in turns (round 1 of every variant, then round 2, ...), so
a host's drift shows in every column alike rather than in one. Each run is
gpu_engine_bench.py; the table lists every run's ms/step and its ratio to the floor.

    python benchmarks/decode_turns.py --configs llama3-8b llama3-8b-fp8 qwen3-30b-a3b \\
        --backends triton tuned --env PDSERVE_TRITON_GATED_GEMV=0,1 --rounds 2

--configs takes names under benchmarks/configs/ or paths; --env NAME=V1,V2 (repeatable)
makes one variant per value; arguments after `--` go to every gpu_engine_bench.py run
after the defaults, which they override (batch 1 at 1k context, 64 timed steps, one
128-token prefill).
--dry-run prints the commands in the order they would run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH_DEFAULTS = ["--batch", "1", "--ctx", "1024", "--decode-steps", "64",
                  "--prefill-prompts", "1", "--prefill-len", "128"]  # fmt: skip


@dataclass(frozen=True)
class Variant:
    config: str  # a path to the model's config.json
    backend: str
    env: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return f"{Path(self.config).stem} | {self.backend} | {env or '-'}"


def config_path(name: str) -> str:
    """A name under benchmarks/configs/ (with or without .json), or a path."""
    if os.path.exists(name):
        return name
    path = HERE / "configs" / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        raise ValueError(f"no config {name!r} (neither a path nor {path})")
    return str(path)


def parse_env(specs: list[str]) -> list[tuple[tuple[str, str], ...]]:
    """["A=0,1", "B=x"] -> every combination: ((A, 0), (B, x)), ((A, 1), (B, x))."""
    axes = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"--env takes NAME=V1[,V2...], got {spec!r}")
        axes.append([(name, v) for v in values.split(",")])
    return list(itertools.product(*axes)) or [()]


def plan(configs, backends, envs, rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in the order they run: every variant once per round."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    variants = [Variant(c, b, e) for c in configs for b in backends for e in envs]
    return [(r, v) for r in range(1, rounds + 1) for v in variants]


def command(variant: Variant, json_out: str, bench_args: list[str]) -> list[str]:
    return [sys.executable, str(HERE / "gpu_engine_bench.py"), "--config", variant.config,
            "--kernel-backend", variant.backend, *bench_args, "--json-out", json_out]  # fmt: skip


def table(results: dict[Variant, list[dict | None]]) -> str:
    """One row per variant and batch size: each run's ms/step (a failed run as
    'failed'), their spread, and the best run's ratio to the floor."""
    lines = ["| model | backend | env | batch | ms/step, each run | x floor (best) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for variant, runs in results.items():
        batches = sorted({row["batch"] for run in runs if run for row in run["decode"]})
        for b in batches or [None]:
            rows = [next((r for r in run["decode"] if r["batch"] == b), None) if run else None
                    for run in runs]  # fmt: skip
            times = ", ".join("failed" if r is None else f"{r['ms_per_step']:.2f}" for r in rows)
            done = [r for r in rows if r is not None]
            best = min(done, key=lambda r: r["ms_per_step"]) if done else None
            ratio = f"{best['ms_per_step'] / best['floor_ms']:.2f}x" if best else "-"
            lines.append(f"| {variant.label} | {b if b is not None else '-'} | {times} | {ratio} |")
    return "\n".join(lines)


def run(order, bench_args, timeout: float, log=print) -> dict[Variant, list[dict | None]]:
    results: dict[Variant, list[dict | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rnd, variant) in enumerate(order):
            out = os.path.join(tmp, f"{i}.json")
            env = {**os.environ, **dict(variant.env)}
            log(f"round {rnd}: {variant.label}", flush=True)
            try:
                proc = subprocess.run(
                    command(variant, out, bench_args), env=env, timeout=timeout,
                    capture_output=True, text=True,
                )  # fmt: skip
                ok = proc.returncode == 0 and os.path.exists(out)
                if not ok:
                    log(f"  failed (rc {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
            except subprocess.TimeoutExpired:
                ok = False
                log(f"  failed: over {timeout:g} s", flush=True)
            result = json.loads(Path(out).read_text()) if ok else None
            for row in result["decode"] if result else []:
                log(f"  batch {row['batch']}: {row['ms_per_step']:.2f} ms/step", flush=True)
            results.setdefault(variant, []).append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = BENCH_DEFAULTS
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], BENCH_DEFAULTS + argv[cut + 1 :]  # later ones win
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--backends", nargs="+", default=["triton"])
    ap.add_argument("--env", action="append", default=[], metavar="NAME=V1,V2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = ap.parse_args(argv)
    try:
        configs = [config_path(c) for c in args.configs]
        order = plan(configs, args.backends, parse_env(args.env), args.rounds)
    except ValueError as e:
        ap.error(str(e))
    if args.dry_run:
        for _, variant in order:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in variant.env)
            cmd = shlex.join(command(variant, "<json>", bench_args))
            print(f"{env} {cmd}".strip())
        return
    print(table(run(order, bench_args, args.timeout)))


if __name__ == "__main__":
    main()
