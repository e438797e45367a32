"""A decoder layer's residual add + RMSNorm folded into the one-row GEMV that reads its
output first: one launch instead of two, and no hand-off between them.

Each program of the GEMV computes the row's rms from h + residual itself (row_rstd in
norm.py, before its K loop, while its first weight tile loads), then builds every x
tile from h, residual and the norm's weight as fused_add_rms_norm rounds them
(normed_cols); the first program stores h + residual (the next residual) and the
normalised row (what a MoE's experts read after the router). gemv.py and fp8_gemv.py
carry it as HAS_NORM; add_rms_norm_gemv here and fp8_gemv.add_rms_norm_fp8_gemv launch it.

When it pays: every program reads the whole row from L2 before its K loop (h and the
residual, for the rms), then h, the residual and the norm's weight for each tile, where
a plain GEMV reads x once a tile. On an H100 (batch 1, docs/performance.md) folding
every norm made Qwen3-30B-A3B faster (3.33 -> 3.28 ms; its qkv fold gave most of it,
the router's alone 0.01 ms) and Llama-3-8B slower (bf16 5.54 -> 5.66, FP8 3.52 ->
3.57 ms). Per SM, Qwen3's qkv programs read 80 KB of rows before their K loops, Llama's
qkv 190 KB and its gate_up 900 KB. So a bf16 GEMV takes the fold when its programs
read at most FOLD_MAX_ROW_BYTES_PER_SM that way; an FP8 GEMV, whose K loop is
issue-bound and whose tiles do more work per x element, only at one program per SM
at most (a router-sized grid)."""

from __future__ import annotations

import torch
import triton

from services.kernels.triton._launch import check_device, device_sms, is_interpreted
from services.kernels.triton.gemv import _check, _gemv_kernel, launch, launch_config
from services.kernels.triton.norm import check_fold_inputs

FOLD_MAX_ROW_BYTES_PER_SM = 128 * 1024
FP8_FOLD_MAX_PROGRAMS_PER_SM = 1


def fold_pays(x: torch.Tensor, n: int, block_n: int, fp8: bool = False) -> bool:
    """Whether folding the norm into a GEMV of n output rows, block_n per program, beats
    the norm's own kernel on x's GPU (always true under the interpreter, so CPU tests
    run the fold). fp8: an FP8 GEMV's."""
    if is_interpreted(_gemv_kernel):
        return True
    programs_per_sm = triton.cdiv(n, block_n) / device_sms(x)
    if fp8:
        return programs_per_sm <= FP8_FOLD_MAX_PROGRAMS_PER_SM
    row_bytes = 2 * x.shape[-1] * x.element_size()  # h and the residual, for the rms
    return programs_per_sm * row_bytes <= FOLD_MAX_ROW_BYTES_PER_SM


def add_rms_norm_gemv(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config=None,
    row_stages: int | None = None,
    row_fold: tuple[int, ...] | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gemv(x, weight, bias), x, h + residual) for x = fused_add_rms_norm(h, residual,
    norm_weight, eps)[0], one row, in one launch. config, row_stages, row_fold: as gemv's;
    gated: a gate_up weight, silu(gate) * up in place of its output (gated_gemv.py)."""
    _check(h, weight, bias)
    check_fold_inputs("add_rms_norm_gemv", h, residual, norm_weight)
    check_device(_gemv_kernel, h, residual, norm_weight, weight)
    h, residual, norm_weight = h.contiguous(), residual.contiguous(), norm_weight.contiguous()
    n = weight.shape[0]
    out = torch.empty(1, n // 2 if gated else n, dtype=h.dtype, device=h.device)
    normed, res_out = torch.empty_like(h), torch.empty_like(h)
    cfg = launch_config(h, n, config, row_stages, row_fold)
    norm = (residual, norm_weight, res_out, normed, eps)
    launch(h, weight, bias, out, cfg, norm=norm, gated=gated)
    return out, normed, res_out
