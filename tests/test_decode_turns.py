"""benchmarks/decode_turns.py: variants in turns, the environment's combinations, the
table of every run, and a run that fails shown as failed (the step times themselves
need a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.decode_turns import Variant, config_path, parse_env, plan, run, table

ROOT = Path(__file__).resolve().parents[1]


def test_every_variant_runs_once_a_round_in_the_same_order():
    envs = parse_env(["A=0,1", "B=x"])
    assert envs == [(("A", "0"), ("B", "x")), (("A", "1"), ("B", "x"))]
    order = plan(["m1", "m2"], ["triton", "tuned"], envs, rounds=2)
    assert len(order) == 16
    first, second = [v for r, v in order if r == 1], [v for r, v in order if r == 2]
    assert first == second and len(set(first)) == 8
    assert first[0] == Variant("m1", "triton", (("A", "0"), ("B", "x")))
    assert first[1].env == (("A", "1"), ("B", "x"))  # the switch alternates innermost
    assert parse_env([]) == [()]


@pytest.mark.parametrize("bad", ["A", "=1", "A="])
def test_a_malformed_env_is_refused(bad):
    with pytest.raises(ValueError, match="NAME=V1"):
        parse_env([bad])


def test_config_names_and_paths():
    assert config_path("llama3-8b").endswith("benchmarks/configs/llama3-8b.json")
    assert config_path("llama3-8b.json") == config_path("llama3-8b")
    with pytest.raises(ValueError, match="no config 'nope'"):
        config_path("nope")
    with pytest.raises(ValueError, match="rounds"):
        plan(["m"], ["triton"], [()], rounds=0)


def test_table_lists_every_run_and_the_best_ratio():
    v = Variant("/x/llama3-8b.json", "triton", (("S", "1"),))

    def result(ms):
        return {"decode": [{"batch": 1, "ms_per_step": ms, "floor_ms": 5.0}]}

    text = table({v: [result(5.6), None, result(5.5)]})
    assert "| llama3-8b | triton | S=1 | 1 | 5.60, failed, 5.50 | 1.10x |" in text
    assert "| llama3-8b | triton | S=1 | - | failed | - |" in table({v: [None]})


def test_dry_run_prints_the_commands_in_turns():
    out = subprocess.run(
        [sys.executable, "benchmarks/decode_turns.py", "--configs", "tiny-llama",
         "--backends", "triton", "tuned", "--env", "S=0,1", "--rounds", "2", "--dry-run",
         "--", "--batch", "1", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 8 and lines[:4] == lines[4:]
    assert lines[0].startswith("S=0 ") and lines[1].startswith("S=1 ")
    assert "--kernel-backend triton --batch 1 --ctx 1024" in lines[0]
    assert lines[0].endswith("--prefill-len 128 --batch 1 4 --json-out '<json>'")  # wins
    bad = subprocess.run(
        [sys.executable, "benchmarks/decode_turns.py", "--configs", "nope", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "no config 'nope'" in bad.stderr


def test_a_run_that_fails_is_reported_not_lost():
    """gpu_engine_bench.py itself, here without its model's GPU: the run fails, its
    error is logged and the table shows it."""
    logged = []
    order = plan([config_path("tiny-llama")], ["triton"], [(("CUDA_VISIBLE_DEVICES", ""),)], 1)
    results = run(order, ["--batch", "1"], timeout=120, log=lambda *a, **k: logged.append(a[0]))
    [(variant, runs)] = results.items()
    assert runs == [None]
    assert any(line.startswith("  failed (rc ") for line in logged), logged
    assert "| tiny-llama | triton | CUDA_VISIBLE_DEVICES= | - | failed | - |" in table(results)
