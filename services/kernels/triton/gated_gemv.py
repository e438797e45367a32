"""A dense MLP's gate_up linear and its silu_and_mul in one launch, for decode rows (one
row for FP8 weights, up to 8 for bf16 / fp16 / fp32).

At batch 1 the SiLU-and-mul is a kernel of its own between the gate_up GEMV and the
down GEMV: a launch, a write of the gate_up row and a read of it back (on an H100 1.5 us
a layer, 0.05 ms of Llama-3-8B's step with PDL off). Here each GEMV program takes
BLOCK_N / 2 rows of the gate and the same rows of the up half, so it holds both sums
of its outputs and stores silu(gate) * up itself, rounded as the separate kernels round
(each sum to x's dtype first, as the linear's output is; activation.silu_mul). The
weight is read exactly as the plain GEMV reads it: the same tiles, K loop and programs,
so the loop costs what it did; only the row pairing and the epilogue differ.

gemv.py carries it as GATED (the tile's rows half gate, half up; one row's FMA path and
the 2-8 rows' tensor-core path alike); fp8_gemv.py as two
tiles of rows, the gate's and the up's, each with its own block scales. Both compose
with the norm fold (norm_fold.add_rms_norm_gemv and fp8_gemv.add_rms_norm_fp8_gemv take
gated=True)."""

from __future__ import annotations

import torch

from services.kernels.fp8 import Fp8Format
from services.kernels.triton import fp8_gemv
from services.kernels.triton._launch import check_device
from services.kernels.triton.gemv import _check, _gemv_kernel, launch, launch_config


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config=None,
    row_stages: int | None = None,
    row_fold: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """silu_and_mul(gemv(x, weight, bias)) for x [M <= 8, K] and a gate_up weight
    [2I, K] (the gate's rows, then the up's): [M, I] in x's dtype, one launch. config,
    row_stages, row_fold: as gemv's (split_k must be 1)."""
    _check(x, weight, bias)
    _check_gated(weight.shape[0])
    check_device(_gemv_kernel, x, weight)
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = launch_config(x, n, config, row_stages, row_fold)
    launch(x, weight, bias, out, cfg, gated=True)
    return out


def fp8_gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    fmt: Fp8Format,
    bias: torch.Tensor | None,
    *,
    config=None,
    num_stages: int | None = None,
    fold: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """silu_and_mul(fp8_gemv(x, weight, ...)) for one row and an FP8 gate_up weight, one
    launch: [1, I] in x's dtype. config, num_stages, fold: as fp8_gemv's."""
    fp8_gemv._check(x, fmt, weight)
    _check_gated(weight.shape[0])
    return fp8_gemv.run(
        x.contiguous(), weight, weight_scale, fmt, bias, config, num_stages, fold, gated=True
    )


def _check_gated(n: int) -> None:
    if n % 2:
        raise ValueError(f"a gated GEMV takes a gate_up weight of 2I rows; got {n} rows")
