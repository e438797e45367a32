"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow the torch reference: the sum (x + residual) is rounded to its dtype
and stored, normalisation runs in fp32 on that rounded value, the normalised row is
rounded to the input dtype and only then multiplied by the weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    pdl_sync,
    rows_per_program,
    use_pdl,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    inner,  # rows are (outer, inner) pairs: row r = (r // inner, r % inner)
    stride_x0,
    stride_x1,
    stride_xd,
    stride_r0,
    stride_r1,
    stride_rd,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    outer = rows64 // inner
    inner_idx = rows64 % inner

    x_off = outer * stride_x0 + inner_idx * stride_x1
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :] * stride_xd, mask=mask, other=0.0)
    dense = rows64[:, None] * n_cols + cols[None, :]
    if HAS_RESIDUAL:
        r_off = outer * stride_r0 + inner_idx * stride_r1
        r = tl.load(res_ptr + r_off[:, None] + cols[None, :] * stride_rd, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + dense, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)

    var = tl.sum(xf * xf, axis=1) / n_cols
    y = xf * tl.rsqrt(var + eps)[:, None]
    # round to the (summed) input dtype before the weight, as the reference does
    if HAS_RESIDUAL:
        y = y.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y * w[None, :]
    tl.store(out_ptr + dense, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_rstd(h_ptr, res_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / rms of one row of h + res, the sum rounded to res's dtype first (as
    fused_add_rms_norm stores it): the prologue of a linear that folds the norm in."""
    offs = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ok = (k + offs) < K
        h = tl.load(h_ptr + k + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + k + offs, mask=ok, other=0.0).to(tl.float32)
        s = (h + r).to(res_ptr.dtype.element_ty).to(tl.float32)
        sq += s * s
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def normed_cols(h_ptr, res_ptr, nw_ptr, res_out_ptr, x_out_ptr, cols, mask, rstd, STORE):
    """fused_add_rms_norm of one row at cols (any shape), rounded as its kernel rounds,
    as fp32; with STORE (one program of the linear) h + res and the normalised values
    are stored too, so the layer's later readers (the next residual, a MoE's experts)
    find what the norm kernel would have written."""
    ty = res_ptr.dtype.element_ty
    h = tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    s = (h + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(ty)
    y = (s.to(tl.float32) * rstd).to(ty).to(tl.float32)
    x = (y * tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(ty)
    if STORE:
        tl.store(res_out_ptr + cols, s, mask=mask)
        tl.store(x_out_ptr + cols, x, mask=mask)
    return x.to(tl.float32)


def check_fold_inputs(name: str, h, residual, norm_weight) -> None:
    """A fold's norm inputs (norm_fold.py): one row h and residual [1, K] and the norm's
    weight [K], all of one dtype."""
    if h.shape[0] != 1 or residual.shape != h.shape or norm_weight.shape != h.shape[1:]:
        raise ValueError(
            f"{name} takes one row: h and residual [1, K], norm_weight [K]; got "
            f"{tuple(h.shape)}, {tuple(residual.shape)}, {tuple(norm_weight.shape)}"
        )
    if residual.dtype != h.dtype or norm_weight.dtype != h.dtype:
        raise ValueError(
            f"{name} needs h, residual and norm_weight of one dtype, got "
            f"{h.dtype}, {residual.dtype} and {norm_weight.dtype}"
        )


def fold_launch_args(x, norm) -> dict:
    """A GEMV kernel's HAS_NORM arguments: norm = (residual, norm_weight, residual_out,
    normed_out, eps), or None (x stands in for the pointers the kernel never reads)."""
    if norm is None:
        ptrs, eps = (x, x, x, x), 0.0
    else:
        ptrs, eps = norm[:4], float(norm[4])
    names = ("res_ptr", "nw_ptr", "res_out_ptr", "x_out_ptr")
    return {**dict(zip(names, ptrs)), "eps": eps, "HAS_NORM": norm is not None}


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(tensor, n_rows, inner, stride0, stride1): rows addressed as two strided dims, so
    q/k head views of a fused qkv output need no copy."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _launch(x, residual, weight, eps):
    n_cols = x.shape[-1]
    xv, n_rows, inner, sx0, sx1 = _rows_view(x)
    out_dtype = x.dtype
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        rv, _, _, sr0, sr1 = _rows_view(residual)
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        srd = rv.stride(-1)
    else:
        rv, sr0, sr1, srd = xv, 0, 0, 0
    out = torch.empty(x.shape, dtype=torch.promote_types(out_dtype, weight.dtype), device=x.device)
    if n_rows == 0:
        return out, res_out
    check_device(_rms_norm_kernel, x, weight)
    interp = is_interpreted(_rms_norm_kernel)
    block_n = next_pow2(n_cols)
    block_r = rows_per_program(interp, n_rows, block_n)
    num_warps = 4 if block_n <= 2048 else (8 if block_n <= 8192 else 16)
    pdl = use_pdl(x)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        xv,
        rv,
        weight,
        out,
        res_out if res_out is not None else out,
        n_rows,
        n_cols,
        inner,
        sx0,
        sx1,
        xv.stride(-1),
        sr0,
        sr1,
        srd,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalise(x) over the last dim; x may be a strided [T, H, D] view."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), one pass over memory."""
    return _launch(x, residual, weight, eps)
