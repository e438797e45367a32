"""KV-cache write (vLLM's reshape_and_cache): k, v [T, Hk, D] -> caches
[num_blocks, block_size, Hk, D] at flat slots block_id * block_size + offset.

Every tensor is addressed through its strides, so the caches may be the per-layer
strided views of the engine's block-major [num_blocks, layers, 2, bs, Hk, D] tensor
and k / v may be column slices of a fused qkv output. Slots < 0 are skipped (padding).

FP8 caches (float8_e4m3fn; float8_e4m3fnuz on MI300) store x / scale, saturated to the
type's max (448; 240) and rounded to nearest even, exactly as the torch reference does
(services/kernels/interface.py). The interpreter runs fn caches only."""

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


@triton.jit
def _round_to_fp8_e4m3(x, scale, TOP: tl.constexpr, MIN_EXP: tl.constexpr):
    """x / scale saturated to +-TOP and rounded to the nearest e4m3 value (ties to even),
    still in fp32, so the cast to fp8 that follows is exact. The rounding is done here,
    not by the cast, because Triton's interpreter (the CPU tests) drops the carry when a
    mantissa rounds up (-125.3 became -64); one code path for GPU and tests. fn: TOP 448,
    normals from 2^-6; fnuz: TOP 240, normals from 2^-7."""
    y = tl.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's: the same ties
    y = tl.minimum(tl.maximum(y, -TOP), TOP)
    a = tl.abs(y)
    # e4m3 keeps 3 mantissa bits above 2^MIN_EXP and a fixed step of 2^(MIN_EXP - 3)
    # below it (subnormals)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, MIN_EXP) - 3  # log2 of the spacing of e4m3 values around a
    step = ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    t = a * inv_step  # exact (a power of two), in [0, 16)
    f = tl.floor(t)
    d = t - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd)) * step
    return tl.where(y < 0.0, -r, r)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_tokens,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_TOP: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < n_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    tok_ok = tok_ok & (slot >= 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hd = tl.arange(0, BLOCK_HD)
    head = hd // HEAD_DIM
    dim = hd % HEAD_DIM
    mask = tok_ok[:, None] & (hd < NUM_HEADS * HEAD_DIM)[None, :]
    t64 = toks.to(tl.int64)[:, None]

    k = tl.load(
        k_ptr + t64 * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd, mask=mask
    )
    if FP8:
        k = _round_to_fp8_e4m3(k, k_scale, FP8_TOP, FP8_MIN_EXP)
    kc = (blk * stride_kc_b + off * stride_kc_s)[:, None]
    kc += head[None, :] * stride_kc_h + dim[None, :] * stride_kc_d
    tl.store(k_cache_ptr + kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        v_ptr + t64 * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask
    )
    if FP8:
        v = _round_to_fp8_e4m3(v, v_scale, FP8_TOP, FP8_MIN_EXP)
    vc = (blk * stride_vc_b + off * stride_vc_s)[:, None]
    vc += head[None, :] * stride_vc_h + dim[None, :] * stride_vc_d
    tl.store(v_cache_ptr + vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
    # e4m3's range and smallest normal exponent: fn 448 / -6, fnuz 240 / -7
    info = torch.finfo(k_cache.dtype if fp8 else torch.float8_e4m3fn)
    fp8_top, fp8_min_exp = info.max, int(math.log2(info.smallest_normal))
    n_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(
            f"cache {tuple(k_cache.shape)} is not [blocks, bs, {num_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (n_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({n_tokens},)")
    if n_tokens == 0:
        return
    check_device(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    slot_mapping = slot_mapping.contiguous()
    interp = is_interpreted(_store_kv_kernel)
    block_hd = next_pow2(num_heads * head_dim)
    block_t = rows_per_program(interp, n_tokens, block_hd)
    pdl = use_pdl(k)
    _store_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        n_tokens,
        1.0 if k_scale is None else float(k_scale),
        1.0 if v_scale is None else float(v_scale),
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
        FP8=fp8,
        FP8_TOP=fp8_top,
        FP8_MIN_EXP=fp8_min_exp,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
