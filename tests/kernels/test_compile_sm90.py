"""The one-row GEMVs compiled for an H100/H200 on this CPU machine (Triton's own
ptxas, benchmarks/compile_sm90.py): a K loop asked to be several tiles deep really is
pipelined (cp.async copies into shared memory), a K fold shrinks the registers, and
nothing spills, so a device run measures what was meant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]


def _compile(specs: list[str]) -> dict[str, dict]:
    """compile_sm90.py's report for each KERNEL:sizes spec."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
    out = subprocess.run(
        [sys.executable, "benchmarks/compile_sm90.py", *specs],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["kernel"]: r for r in map(json.loads, out.stdout.splitlines())}


@pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="this triton wheel has no ptxas")
def test_stages_pipeline_the_k_loop_without_spills():
    kernels = {"fp8": "8,1024,4", "gemv": "8,1024,4", "gated": "8,256,4", "down": "1,256,4"}
    specs = [f"{k}:{sizes},{stages}" for k, sizes in kernels.items() for stages in (1, 3)]
    # a tile far too big for one warp's registers (ptxas takes ~7 s on it; a 64 x 2048 tile
    # over 4 warps, as this was, took ~4 min)
    specs.append("fp8:8,1024,1,1")
    specs += ["fp8:8,1024,4,1,16", "gemv:8,1024,4,1,8"]  # k_fold: a smaller partial tile
    reports = _compile(specs)
    for kind, sizes in kernels.items():
        plain, deep = reports[f"{kind}:{sizes},1"], reports[f"{kind}:{sizes},3"]
        assert plain["cp_async"] == 0, kind  # one tile in flight: plain loads
        assert deep["cp_async"] > 0 and deep["smem"] > plain["smem"], kind
        assert plain["spill_bytes"] == 0 and deep["spill_bytes"] == 0, kind
    assert reports["fp8:8,1024,1,1"]["spill_bytes"] > 0  # the report does see spills
    for kind, folded in (("fp8", "fp8:8,1024,4,1,16"), ("gemv", "gemv:8,1024,4,1,8")):
        # summing adjacent columns first frees most of the partial tile's registers
        plain = reports[f"{kind}:{kernels[kind]},1"]
        assert reports[folded]["regs"] < 0.75 * plain["regs"], (reports[folded], plain)
        assert reports[folded]["spill_bytes"] == 0


@pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="this triton wheel has no ptxas")
def test_a_row_quantized_by_the_norm_shortens_the_fp8_k_loop():
    """The FP8 GEMV reading x quantized by the norm before it (norm_quant.py) runs fewer
    instructions a K tile than quantizing x itself: the default 8 x 2048 fold-16 tile,
    plain and gated (triton 3.7 on this machine: 647 -> 425 and 679 -> 479)."""
    specs = ["fp8:8,2048,4,1,16", "fp8q:8,2048,4,1,16"]
    specs += ["fp8+silu:8,2048,4,1,16", "fp8q+silu:8,2048,4,1,16"]
    reports = _compile(specs)
    for own, given in ((specs[0], specs[1]), (specs[2], specs[3])):
        assert reports[own]["loop_instructions"] > 0
        assert reports[given]["loop_instructions"] < 0.8 * reports[own]["loop_instructions"]
        assert reports[given]["spill_bytes"] == 0


@pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="this triton wheel has no ptxas")
def test_the_default_tiles_fit_the_programs_per_sm_the_one_wave_rule_assumes():
    """fp8_gemv.default_config picks 16-row tiles where only they fit one wave, counting
    PROGRAMS_PER_SM: what the compiled 8- and 16-row default tiles' registers allow on an
    sm_90 SM (65536 registers, allocated a warp at a time in 256s; 4 warps a program)."""
    from services.kernels.triton.fp8_gemv import PROGRAMS_PER_SM

    reports = _compile([f"fp8:{rows},2048,4,1,16" for rows in PROGRAMS_PER_SM])
    for rows, per_sm in PROGRAMS_PER_SM.items():
        report = reports[f"fp8:{rows},2048,4,1,16"]
        per_warp = -(-report["regs"] * 32 // 256) * 256
        assert 65536 // (4 * per_warp) == per_sm, report
        assert report["spill_bytes"] == 0 and report["smem"] * per_sm <= 228 * 1024, report
