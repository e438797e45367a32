"""A decode row's residual add + RMSNorm that also quantizes the normalised row for the
FP8 GEMV after it: each activation group's scale (128 columns for block weights, the
whole row for per-channel ones) and its values on the e4m3 grid, computed once here
instead of again in every GEMV program.

Why: the one-row FP8 GEMV (fp8_gemv.py) quantizes its tile's slice of x in every
program, about half of its K loop's instructions, and on an H200 that loop is near the
SM's issue limit. A norm sees the whole row, so it can do that work once; the GEMV
then reads the quantized values and scales (PREQUANT) and its loop keeps only the
weight's work: 425 instructions a default 8 x 2048 tile instead of 647, compiled for
sm_90 (docs/performance.md). Same numbers: the same rounding of the normalised row, the
same scale and e4m3 rounding (fp8_gemv._quantized), so the GEMV's output is bit for bit
the one it computes from the normalised row itself (tests/kernels/test_norm_quant.py).
On an H100 the norm's extra work outweighed the GEMVs' gain (PDSERVE_TRITON_FP8_PREQUANT
in triton_backend.py, off by default).

The quantized values are stored in the row's dtype (every e4m3 value is exact in
bf16, fp16 and fp32), so the GEMV's x tile loads them as it loads the row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.fp8 import MIN_AMAX, Fp8Format, fp8_max
from services.kernels.triton import fp8_gemv
from services.kernels.triton._launch import check_device, is_interpreted, pdl_sync, use_pdl
from services.kernels.triton.fp8_round import activation_scale, reciprocal_rn
from services.kernels.triton.norm import check_fold_inputs, normed_cols


@triton.jit
def _norm_quant_kernel(
    h_ptr, res_ptr, nw_ptr, normed_ptr, res_out_ptr, xq_ptr, xs_ptr, eps,
    K: tl.constexpr, GROUP: tl.constexpr, G_P: tl.constexpr, FP8_MAX_: tl.constexpr,
    MIN_AMAX_: tl.constexpr, ROUND_IN_FP32: tl.constexpr, FP8_TY: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    ty = res_ptr.dtype.element_ty
    # the squares summed over a [1, G_P * GROUP] row, the shape fused_add_rms_norm's
    # kernel sums, then the row normalised and stored as the folds round it (normed_cols)
    cols = tl.arange(0, G_P * GROUP)[None, :]
    ok = cols < K
    h = tl.load(h_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    s = (h + tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=1) / K + eps)
    x = normed_cols(h_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, cols, ok, rstd, True)
    # then per group of GROUP columns (zeros past K change no group's amax)
    xg = tl.reshape(x, [G_P, GROUP])
    scale = activation_scale(tl.max(tl.abs(xg), axis=1), MIN_AMAX_, FP8_MAX_)
    inv = reciprocal_rn(scale)
    q = fp8_gemv._quantized(xg, scale[:, None], inv[:, None], FP8_MAX_, ROUND_IN_FP32, FP8_TY)
    offs_g = tl.arange(0, G_P)
    gcols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(xq_ptr + gcols, q.to(xq_ptr.dtype.element_ty), mask=gcols < K)
    tl.store(xs_ptr + offs_g, scale, mask=offs_g * GROUP < K)


def add_rms_norm_quant(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group: int,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, h + residual, xq, xs) for one row [1, K]: fused_add_rms_norm's two
    outputs, then the normed row quantized to fp8_dtype's grid per `group` columns (a
    power of two; group >= K: one scale for the row) as the FP8 GEMV quantizes it: xq
    [1, K] in h's dtype holding the e4m3 values (unscaled, exact in any float dtype),
    xs [ceil(K / group)] fp32 the scales."""
    check_fold_inputs("add_rms_norm_quant", h, residual, norm_weight)
    check_device(_norm_quant_kernel, h, residual, norm_weight)
    k = h.shape[1]
    if group < k and (group < 1 or group & (group - 1)):
        raise ValueError(f"add_rms_norm_quant needs a power-of-two group, got {group}")
    if group >= k:  # the whole row: one group as wide as the row's block
        group = triton.next_power_of_2(k)
    h, residual, norm_weight = h.contiguous(), residual.contiguous(), norm_weight.contiguous()
    groups = triton.cdiv(k, group)
    normed, res_out, xq = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
    xs = torch.empty(groups, dtype=torch.float32, device=h.device)
    g_p = triton.next_power_of_2(groups)
    width = g_p * group  # warps as fused_add_rms_norm's kernel takes them for its block
    warps = 4 if width <= 2048 else 8 if width <= 8192 else 16
    pdl = use_pdl(h)
    _norm_quant_kernel[(1,)](
        h, residual, norm_weight, normed, res_out, xq, xs, float(eps), K=k, GROUP=group,
        G_P=g_p, FP8_MAX_=fp8_max(fp8_dtype), MIN_AMAX_=MIN_AMAX,
        ROUND_IN_FP32=is_interpreted(_norm_quant_kernel), FP8_TY=_triton_fp8(fp8_dtype),
        USE_PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return normed, res_out, xq, xs


def add_rms_norm_quant_fp8_gemv(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    fmt: Fp8Format,
    bias: torch.Tensor | None,
    *,
    config: fp8_gemv.Fp8GemvConfig | None = None,
    num_stages: int | None = None,
    fold: tuple[int, ...] | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_gemv.add_rms_norm_fp8_gemv's (out, normed, h + residual) in two launches: this
    norm, quantizing the row once, then the FP8 GEMV reading it quantized. gated: a
    gate_up weight, silu(gate) * up in place of its output."""
    if not fp8_gemv.supports(h.shape[0], fmt, weight):
        raise ValueError(f"the FP8 GEMV does not take this row and weight ({fmt})")
    k = h.shape[1]
    normed, res_out, xq, xs = add_rms_norm_quant(
        h, residual, norm_weight, eps, fmt.act_group(k), weight.dtype
    )
    out = fp8_gemv.run(
        xq, weight, weight_scale, fmt, bias, config, num_stages, fold, gated=gated, x_scales=xs
    )
    return out, normed, res_out


def _triton_fp8(dtype: torch.dtype):
    return tl.float8e4b8 if dtype == torch.float8_e4m3fnuz else tl.float8e4nv
