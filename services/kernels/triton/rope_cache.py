"""The attention prologue in one launch: optional per-head RMSNorm of q and k (Qwen3's
q_norm / k_norm), neox RoPE on both, and the KV-cache write of the rotated k and of v.

Why: at decode batch sizes each of these is a kernel of a microsecond or two, and the
gaps between kernels cost as much; one by one they are two launches a layer for
Llama, four for Qwen3 (rms_norm twice, rotary_embedding, store_kv_cache).

Each value is rounded where the ops one by one round it (norm.py: the normalised head
rounded to the input dtype before the weight, the product rounded again; rope.py: fp32
rotation rounded to q's dtype; cache.py: k and v stored in the cache's dtype, or FP8
as x / scale rounded to nearest even). The norm's sum of squares adds the two halves
of a head, so it may round differently in the last bit from norm.py's one sum.
One program per token on a GPU (a block of tokens under the interpreter); slots < 0
are padding and write no cache."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.kernels.interface import kv_cache_is_fp8
from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    pdl_sync,
    rows_per_program,
    use_pdl,
)
from services.kernels.triton.cache import _round_to_fp8_e4m3


@triton.jit
def norm_rope_halves(
    x1, x2, w_ptr, dims, dim_ok, c, s, eps, dtype,
    NORM: tl.constexpr, HALF: tl.constexpr, AXIS: tl.constexpr,
):  # fmt: skip
    """Loaded halves of heads (fp32, AXIS the last: dims along it, dim_ok its mask):
    RMSNorm over each head with the weight at w_ptr (NORM), then neox RoPE with c / s,
    each result rounded to dtype (held as fp32). The one place the fused prologues
    (here and attention_prologue.py) spell these roundings."""
    if NORM:
        var = (tl.sum(x1 * x1, axis=AXIS) + tl.sum(x2 * x2, axis=AXIS)) / (2 * HALF)
        r = tl.expand_dims(tl.rsqrt(var + eps), AXIS)
        w1 = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * c - x2 * s).to(dtype).to(tl.float32)
    y2 = (x2 * c + x1 * s).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _norm_rope_heads(
    x_ptr, w_ptr, toks, tok_ok, cos, sin, num_heads, stride_t, stride_h, stride_d, eps,
    NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """[BLOCK_T, BLOCK_H, BLOCK_HALF] halves of the rotated heads, rounded to x's dtype
    (held as fp32), and their mask."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    mask = tok_ok[:, None, None] & (heads < num_heads)[None, :, None] & dim_ok[None, None, :]
    off = (
        toks.to(tl.int64)[:, None, None] * stride_t
        + heads[None, :, None] * stride_h
        + dims[None, None, :] * stride_d
    )
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    c = cos[:, None, :]
    s = sin[:, None, :]
    y1, y2 = norm_rope_halves(x1, x2, w_ptr, dims, dim_ok, c, s, eps, dtype, NORM, HALF, 2)
    return y1, y2, mask, heads, dims


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr, TOP: tl.constexpr, MIN_EXP: tl.constexpr):
    if FP8:
        x = _round_to_fp8_e4m3(x, scale, TOP, MIN_EXP)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_store_kernel(
    pos_ptr, cos_sin_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    n_tokens, num_q_heads, num_kv_heads, eps, k_scale, v_scale,
    stride_pos, stride_cs_t, stride_cs_d,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr, FP8_TOP: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < n_tokens
    dims = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + toks * stride_pos, mask=tok_ok, other=0).to(tl.int64)
    cs_mask = tok_ok[:, None] & (dims < HALF)[None, :]
    cs_off = pos[:, None] * stride_cs_t + dims[None, :] * stride_cs_d
    cos = tl.load(cos_sin_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + cs_off + HALF * stride_cs_d, mask=cs_mask, other=0.0).to(tl.float32)

    # q: normed and rotated into a new contiguous [T, Hq, D]
    q1, q2, q_mask, q_heads, _ = _norm_rope_heads(
        q_ptr, qw_ptr, toks, tok_ok, cos, sin, num_q_heads, stride_qt, stride_qh, stride_qd,
        eps, NORM, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    dense = (
        toks.to(tl.int64)[:, None, None] * (num_q_heads * 2 * HALF)
        + q_heads[None, :, None] * (2 * HALF)
        + dims[None, None, :]
    )
    q_dtype = q_out_ptr.dtype.element_ty
    tl.store(q_out_ptr + dense, q1.to(q_dtype), mask=q_mask)
    tl.store(q_out_ptr + dense + HALF, q2.to(q_dtype), mask=q_mask)

    # k: normed and rotated, then with v into the cache at each token's slot
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    stored = tok_ok & (slot >= 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    k1, k2, k_mask, k_heads, _ = _norm_rope_heads(
        k_ptr, kw_ptr, toks, stored, cos, sin, num_kv_heads, stride_kt, stride_kh, stride_kd,
        eps, NORM, HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip
    kc = (blk * stride_kc_b + off * stride_kc_s)[:, None, None]
    kc += k_heads[None, :, None] * stride_kc_h + dims[None, None, :] * stride_kc_d
    tl.store(k_cache_ptr + kc, _to_cache(k1, k_scale, k_cache_ptr, FP8, FP8_TOP, FP8_MIN_EXP),
             mask=k_mask)  # fmt: skip
    tl.store(k_cache_ptr + kc + HALF * stride_kc_d,
             _to_cache(k2, k_scale, k_cache_ptr, FP8, FP8_TOP, FP8_MIN_EXP), mask=k_mask)  # fmt: skip

    t64 = toks.to(tl.int64)[:, None, None]
    v_off = t64 * stride_vt + k_heads[None, :, None] * stride_vh + dims[None, None, :] * stride_vd
    vc = (blk * stride_vc_b + off * stride_vc_s)[:, None, None]
    vc += k_heads[None, :, None] * stride_vc_h + dims[None, None, :] * stride_vc_d
    for half in tl.static_range(2):
        v = tl.load(v_ptr + v_off + half * HALF * stride_vd, mask=k_mask)
        tl.store(v_cache_ptr + vc + half * HALF * stride_vc_d,
                 _to_cache(v, v_scale, v_cache_ptr, FP8, FP8_TOP, FP8_MIN_EXP), mask=k_mask)  # fmt: skip


def rope_and_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """KernelBackend.rope_and_store_kv: q [T, Hq, D], k and v [T, Hk, D] (strided views
    allowed); returns q normed (qk_norm = (q weight, k weight, eps)) and rotated as a
    new contiguous tensor, and writes k (normed, rotated) and v into the caches."""
    n_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("head_dim must be even and match cos_sin_cache's columns")
    if v.shape != k.shape or k.shape[0] != n_tokens:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match for {n_tokens} tokens"
        )
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache {tuple(k_cache.shape)} is not [blocks, bs, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (n_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({n_tokens},)")
    fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
    info = torch.finfo(k_cache.dtype if fp8 else torch.float8_e4m3fn)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n_tokens == 0:
        return q_out
    check_device(_rope_store_kernel, q, k, v, positions, cos_sin_cache, k_cache, slot_mapping)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    half = head_dim // 2
    block_hq, block_hk, block_half = (
        next_pow2(num_q_heads),
        next_pow2(num_kv_heads),
        next_pow2(half),
    )
    interp = is_interpreted(_rope_store_kernel)
    block_t = rows_per_program(interp, n_tokens, block_hq * block_half * 2)
    pdl = use_pdl(q)
    _rope_store_kernel[(triton.cdiv(n_tokens, block_t),)](
        positions, cos_sin_cache, q, k, v, q_out, q_w, k_w, k_cache, v_cache,
        slot_mapping.contiguous(), n_tokens, num_q_heads, num_kv_heads, float(eps),
        1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale),
        positions.stride(0), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NORM=qk_norm is not None, HALF=half, BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, FP8=fp8,
        FP8_TOP=info.max, FP8_MIN_EXP=int(math.log2(info.smallest_normal)),
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return q_out
