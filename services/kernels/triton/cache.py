"""KV-cache write (vLLM's reshape_and_cache): k, v [T, Hk, D] -> caches
[num_blocks, block_size, Hk, D] at flat slots block_id * block_size + offset.

Every tensor is addressed through its strides, so the caches may be the per-layer
strided views of the engine's block-major [num_blocks, layers, 2, bs, Hk, D] tensor
and k / v may be column slices of a fused qkv output. Slots < 0 are skipped (padding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    rows_per_program,
)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_tokens,
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
):
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
    kc = (blk * stride_kc_b + off * stride_kc_s)[:, None]
    kc += head[None, :] * stride_kc_h + dim[None, :] * stride_kc_d
    tl.store(k_cache_ptr + kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(
        v_ptr + t64 * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask
    )
    vc = (blk * stride_vc_b + off * stride_vc_s)[:, None]
    vc += head[None, :] * stride_vc_h + dim[None, :] * stride_vc_d
    tl.store(v_cache_ptr + vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
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
    _store_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        n_tokens,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
        num_warps=4,
    )
