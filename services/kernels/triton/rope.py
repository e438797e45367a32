"""Neox-style (rotate-half) rotary embedding for q and k in one launch.

cos_sin_cache is [max_pos, D]: cos in the first D/2 columns, sin in the rest (any
frequency scaling, e.g. llama3, is already baked in). Math in fp32, result rounded to
the input dtype, as the torch reference does."""

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
def _rotate_heads(
    x_ptr,
    out_ptr,
    toks,
    tok_ok,
    cos,
    sin,
    num_heads,
    stride_t,
    stride_h,
    stride_d,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = tok_ok[:, None, None] & (heads < num_heads)[None, :, None] & (dims < HALF)[None, None, :]
    off = (
        toks.to(tl.int64)[:, None, None] * stride_t
        + heads[None, :, None] * stride_h
        + dims[None, None, :] * stride_d
    )
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    dense = (
        toks.to(tl.int64)[:, None, None] * (num_heads * 2 * HALF)
        + heads[None, :, None] * (2 * HALF)
        + dims[None, None, :]
    )
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + dense, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(out_ptr + dense + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    n_tokens,
    num_q_heads,
    num_k_heads,
    stride_pos,
    stride_cs_t,
    stride_cs_d,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < n_tokens
    dims = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + toks * stride_pos, mask=tok_ok, other=0).to(tl.int64)
    cs_mask = tok_ok[:, None] & (dims < HALF)[None, :]
    cs_off = pos[:, None] * stride_cs_t + dims[None, :] * stride_cs_d
    cos = tl.load(cos_sin_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + cs_off + HALF * stride_cs_d, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, toks, tok_ok, cos, sin, num_q_heads,
        stride_qt, stride_qh, stride_qd, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, toks, tok_ok, cos, sin, num_k_heads,
        stride_kt, stride_kh, stride_kd, HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (strided views allowed), positions [T] -> new
    contiguous (q_rot, k_rot) in the input dtypes."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("rotary_embedding expects q [T, Hq, D] and k [T, Hk, D]")
    n_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2 or k.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("head_dim must be even and match cos_sin_cache's columns")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if n_tokens == 0:
        return q_out, k_out
    check_device(_rope_kernel, q, k, positions, cos_sin_cache)
    half = head_dim // 2
    block_hq, block_hk, block_half = next_pow2(num_q_heads), next_pow2(k.shape[1]), next_pow2(half)
    interp = is_interpreted(_rope_kernel)
    block_t = rows_per_program(interp, n_tokens, block_hq * block_half * 2)
    pdl = use_pdl(q)
    _rope_kernel[(triton.cdiv(n_tokens, block_t),)](
        positions,
        cos_sin_cache,
        q,
        k,
        q_out,
        k_out,
        n_tokens,
        num_q_heads,
        k.shape[1],
        positions.stride(0),
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        *q.stride(),
        *k.stride(),
        HALF=half,
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q_out, k_out
