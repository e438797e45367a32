"""rope_and_store_kv inside the decode attention kernel (attention.py's PROLOGUE).

Why: at batch-1 decode the separate prologue kernel (rope_cache.py) is 2.5-3 us a
layer plus its launch, for work the attention programs can do themselves. In a batch
of decode rows only, each (sequence, KV head, key split) program rotates its own
query heads (Qwen3: normed first) from the qkv projection's output, and the program
whose key split holds the sequence's newest position also rotates that token's k and
writes k and v into the cache, then waits at a CTA barrier before its key loop reads
them back (no other program reads that position).

Taking the newest K / V from registers instead (a select in every key tile) ran
slower: 185 registers against 96 and another key-tile pipeline; on an H100, Llama-3-8B
FP8 batch 64 went 8.49 to 9.74 ms a step, where this way gives 8.48
(docs/performance.md).

Roundings follow rope_cache.py: every value is rounded to the input dtype where the
ops one by one round it, the stored K / V as store_kv_cache stores them. Only a batch
of one-query rows qualifies (a prefill chunk's later rows read keys another program
would write), and only a power-of-two head_dim (the rotated halves are joined into
the q tile the key loop multiplies)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.kernels.triton.cache import _round_to_fp8_e4m3
from services.kernels.triton.rope_cache import norm_rope_halves


@dataclass(frozen=True)
class AttentionPrologue:
    """What rope_and_store_kv takes besides q, the caches and their scales (which
    paged_attention has): k and v [T, Hk, D] (strided views allowed), positions and
    slot_mapping [T], the [max_pos, D] cos / sin table and Qwen3's (q weight, k
    weight, eps)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


def prologue_fits(head_dim: int, max_query_len: int) -> bool:
    """Whether a batch can take the prologue in its attention launch."""
    return max_query_len == 1 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def prologue_args(
    p: AttentionPrologue | None, q: torch.Tensor, k_cache: torch.Tensor, fp8: bool, k_scale
) -> tuple[list, dict]:
    """The kernel's prologue arguments and constexprs (placeholders when p is None);
    k_scale: the FP8 cache's K scale (None: 1.0)."""
    if p is None:
        return [q, q, q, q, q, q, q, 0.0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0], {
            "PROLOGUE": False, "NORM": False, "FP8_TOP": 0.0, "FP8_MIN_EXP": 0,
        }  # fmt: skip
    n_tokens, _, head_dim = q.shape
    if p.k.shape != p.v.shape or p.k.shape[0] != n_tokens or p.k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(p.k.shape)} and v {tuple(p.v.shape)} do not match q")
    if p.slot_mapping.shape != (n_tokens,) or p.positions.shape != (n_tokens,):
        raise ValueError(f"positions and slot_mapping must be ({n_tokens},)")
    if p.cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("cos_sin_cache's columns must match head_dim")
    qw = kw = q
    eps = 0.0
    if p.qk_norm is not None:
        qw, kw, eps = p.qk_norm
    info = torch.finfo(k_cache.dtype if fp8 else torch.float8_e4m3fn)
    args = [p.positions, p.cos_sin_cache, p.k, p.v, qw, kw, p.slot_mapping, float(eps),
            1.0 if k_scale is None else float(k_scale), p.positions.stride(0),
            *p.cos_sin_cache.stride(), *p.k.stride(), *p.v.stride()]  # fmt: skip
    return args, {
        "PROLOGUE": True,
        "NORM": p.qk_norm is not None,
        "FP8_TOP": float(info.max),
        "FP8_MIN_EXP": int(math.log2(info.smallest_normal)),
    }


@triton.jit
def rotated_q_tile(
    q_ptr, qw_ptr, pos_ptr, cs_ptr, tok, head, row_ok, eps,
    stride_qt, stride_qh, stride_qd, stride_pos, stride_cs_t, stride_cs_d,
    NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The q tile [BLOCK_M, 2 * HALF] in q's dtype: each row's head normed and rotated
    at its token's position."""
    dims = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + tok * stride_pos, mask=row_ok, other=0).to(tl.int64)
    cs = cs_ptr + pos[:, None] * stride_cs_t + dims[None, :] * stride_cs_d
    c = tl.load(cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    s = tl.load(cs + HALF * stride_cs_d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    x1 = tl.load(x, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    y1, y2 = norm_rope_halves(x1, x2, qw_ptr, dims, dims < HALF, c, s, eps, dtype, NORM, HALF, 1)
    q = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (BLOCK_M, 2 * HALF))
    return q.to(dtype)


@triton.jit
def store_new_kv(
    k_ptr, v_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, tok, kv_head, owns, eps, k_scale, v_scale,
    k_cache_ptr, v_cache_ptr,
    stride_pos, stride_cs_t, stride_cs_d, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_kb, stride_ks, stride_kh_c, stride_kd_c,
    stride_vb, stride_vs, stride_vh_c, stride_vd_c,
    NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, FP8_TOP: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    """Token tok's k (normed, rotated) and v for one KV head into the caches at its slot
    when `owns` (a slot < 0 is padding: nothing is stored); other programs load and
    store nothing (masked). Then every thread of the CTA waits until the stores are
    visible to the others: the key loop after this reads them back."""
    dims = tl.arange(0, HALF)
    all_dims = tl.arange(0, 2 * HALF)[None, :]  # k and v as one-row tiles [1, 2 * HALF]
    slot = tl.load(slot_ptr + tok, mask=owns, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + tok * stride_pos, mask=owns, other=0).to(tl.int64)
    cs = cs_ptr + pos * stride_cs_t + dims[None, :] * stride_cs_d
    c = tl.load(cs, mask=owns, other=0.0).to(tl.float32)
    s = tl.load(cs + HALF * stride_cs_d, mask=owns, other=0.0).to(tl.float32)
    k = k_ptr + tok * stride_kt + kv_head * stride_kh + dims[None, :] * stride_kd
    k1 = tl.load(k, mask=owns, other=0.0).to(tl.float32)
    k2 = tl.load(k + HALF * stride_kd, mask=owns, other=0.0).to(tl.float32)
    dtype = k_ptr.dtype.element_ty
    y1, y2 = norm_rope_halves(k1, k2, kw_ptr, dims, dims < HALF, c, s, eps, dtype, NORM, HALF, 1)
    k_new = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (1, 2 * HALF))
    v_new = tl.load(v_ptr + tok * stride_vt + kv_head * stride_vh + all_dims * stride_vd,
                    mask=owns, other=0.0)  # fmt: skip
    if FP8:
        k_new = _round_to_fp8_e4m3(k_new, k_scale, FP8_TOP, FP8_MIN_EXP)
        v_new = _round_to_fp8_e4m3(v_new, v_scale, FP8_TOP, FP8_MIN_EXP)
    k_new = k_new.to(k_cache_ptr.dtype.element_ty)
    v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    store = owns & (slot >= 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    kc = k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh_c
    tl.store(kc + all_dims * stride_kd_c, k_new, mask=store)
    vc = v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh_c
    tl.store(vc + all_dims * stride_vd_c, v_new, mask=store)
    tl.debug_barrier()
