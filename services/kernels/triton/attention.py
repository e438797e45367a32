"""Paged attention over a ragged batch of decode rows and prefill chunks.

One kernel serves every row kind. Sequence i owns query rows cu_seqlens_q[i] :
cu_seqlens_q[i+1] and, after this step, seq_lens[i] keys in the paged cache; its query
row j sits at absolute position context_len + j (context_len = seq_len - query_len),
so a decode row sees every key and a prefill chunk after cached prefix blocks sees the
prefix plus a causal triangle. With a sliding window (SLIDING) row p sees keys
p - window < k <= p, and a program starts at the first tile its first row sees.

Grid: (q_blocks, num_kv_heads, num_splits).
- q_blocks: each program takes BLOCK_Q consecutive query rows of ONE sequence and all
  Q_PER_KV query heads that share one KV head (GQA packing), so a tile is
  BLOCK_M = BLOCK_Q * Q_PER_KV rows: decode rows of a GQA model still fill a
  tensor-core tile, and K/V are read once for the whole head group. Sequence i's q
  blocks are numbered from cu_seqlens_q[i] // BLOCK_Q + i, which bounds the total by
  T // BLOCK_Q + num_seqs without host lengths (no sync; the grid depends on shapes
  only, as CUDA graphs need). A program finds its sequence by binary search over
  cu_seqlens_q and exits if it is past that sequence's rows.
- num_splits > 1 (flash-decoding): the key range of each q block is cut into
  num_splits parts; each writes an unnormalised partial (acc, running max, running
  sum) to fp32 scratch and a second kernel merges them (attention_merge.py): for
  batches with too few (q block, kv head) programs to fill the GPU (small decode
  batches, long contexts). Merging in the kernel, by each q block's last split to
  finish, measured slower at every split count tried (docs/performance.md).

Keys are walked in tiles of TILE_N positions. Each position's block id comes from the
block table (so any block size works, 1 included, and tiles may straddle blocks) and
K/V addresses are block_id * stride_b + offset * stride_s + head * stride_h + d * stride_d:
the caches can be strided views of the engine's block-major tensor. Online softmax in
fp32 with exp2; masked rows never produce NaN (the running max stays -inf and the
exponent uses 0 in its place).

FP8 caches (KV_FP8): k_scale is folded into the softmax scale and v_scale multiplies
the accumulator once at the end (both are per-layer scalars), so the inner loop does no
extra multiply. With a 16-bit q the dots run in fp16 (KV_F16): e4m3 values are exact in
fp16 and the conversion is one instruction per two values on NVIDIA (to bf16 it is a
longer chain); q is multiplied by the softmax scale before its cast, so only a q
component above 65504 / scale (~740k at head_dim 128) could overflow, and P (at most
1) keeps two more bits than in bf16. Measured on the H200 (Llama-3-8B heads, 128
sequences x 4k keys): 389 us against 458 us converting to bf16 and 500 us for a bf16
cache. An fp32 q converts K and V to fp32 as loaded."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.interface import kv_cache_is_fp8
from services.kernels.triton._launch import (
    check_device,
    device_smem,
    device_sms,
    is_interpreted,
    next_pow2,
    pdl_sync,
    use_pdl,
)
from services.kernels.triton.attention_config import attention_config
from services.kernels.triton.attention_merge import merge_splits_kernel, store_rows
from services.kernels.triton.attention_prologue import (
    AttentionPrologue,
    prologue_args,
    prologue_fits,
    rotated_q_tile,
    store_new_kv,
)

_LOG2E = 1.4426950408889634


# Ints that vary from batch to batch are not specialized: Triton would compile another
# variant whenever one turns 1 or a multiple of 16 (a batch's sequence count, its block
# table width), i.e. on the serving path after the warm-up (measured on the H200: the
# only compilations after ready). Neither feeds a vectorized address; nor does the
# window (unspecialized: one variant for every window size).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "sliding_window"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_P] fp32, only when NUM_SPLITS > 1
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32 (running max, running sum)
    qk_scale,  # softmax scale * log2(e) (* k_scale for an FP8 cache; KV_F16: without the softmax scale)
    q_scale,  # KV_F16: the softmax scale, applied to q before its fp16 cast; else unused
    v_scale,  # FP8 cache: the accumulator's factor; else unused
    sliding_window,  # SLIDING: keys p - sliding_window < k <= p; else unused
    num_seqs, num_q_heads, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    # PROLOGUE (attention_prologue.py): rope_and_store_kv's inputs; placeholders otherwise
    pos_ptr, cs_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, slot_ptr, eps, k_store_scale,
    stride_pos, stride_cs_t, stride_cs_d, stride_knt, stride_knh, stride_knd,
    stride_vnt, stride_vnh, stride_vnd,
    Q_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16 (uint16 bits)
    KV_FP8: tl.constexpr,  # FP8 cache: computed in q's dtype, or in fp16 (KV_F16)
    KV_F16: tl.constexpr,
    ROWS: tl.constexpr,  # 0: every sequence; 1: only one-query (decode) ones; 2: the others
    SLIDING: tl.constexpr, USE_PDL: tl.constexpr, PROLOGUE: tl.constexpr, NORM: tl.constexpr,
    FP8_TOP: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The sequence owning this q block: the last i with cu_q[i] // BLOCK_Q + i <= q_block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= query_len:
        return
    if ROWS == 1:
        if query_len != 1:
            return
    if ROWS == 2:
        if query_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    offs_n = tl.arange(0, TILE_N)
    q_row = q_block_local * BLOCK_Q + offs_m // Q_PER_KV  # row within the sequence
    head = kv_head * Q_PER_KV + offs_m % Q_PER_KV
    row_ok = (offs_m < BLOCK_Q * Q_PER_KV) & (q_row < query_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_row).to(tl.int64)

    if PROLOGUE:  # q straight from the qkv projection: normed (Qwen3) and rotated here
        q = rotated_q_tile(q_ptr, qw_ptr, pos_ptr, cs_ptr, tok, head, row_ok, eps, stride_qt,
                           stride_qh, stride_qd, stride_pos, stride_cs_t, stride_cs_d, NORM,
                           HEAD_DIM // 2, BLOCK_M)  # fmt: skip
    else:
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
            + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # fmt: skip
    if KV_F16:
        q = (q.to(tl.float32) * q_scale).to(tl.float16)
    elif not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # keys [0, kv_end) are visible to some row of this block; row r sees keys <= limit[r]
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, query_len)
    limit = context_len + q_row
    num_tiles = tl.cdiv(kv_end, TILE_N)
    first_tile = 0
    if SLIDING:
        # the block's first row sees the earliest keys: skip the tiles before them
        first_tile = tl.maximum(context_len + q_block_local * BLOCK_Q - sliding_window + 1, 0)
        first_tile = first_tile // TILE_N
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles

    if PROLOGUE:  # this step's key and value, stored by the program whose split reads them
        owns = (num_tiles - 1 >= tile_lo) & (num_tiles - 1 < tile_hi)
        tok0 = q_start.to(tl.int64)  # the sequence's one query row
        store_new_kv(k_ptr, v_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, tok0, kv_head, owns, eps,
                     k_store_scale, v_scale, k_cache_ptr, v_cache_ptr, stride_pos, stride_cs_t,
                     stride_cs_d, stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh,
                     stride_vnd, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                     stride_vh, stride_vd, NORM, HEAD_DIM // 2, BLOCK_SIZE, KV_FP8, FP8_TOP,
                     FP8_MIN_EXP)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh

    for t in range(tile_lo, tile_hi):
        kv_pos = t * TILE_N + offs_n
        kv_ok = kv_pos < kv_end
        blk = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = blk * stride_kb + (kv_pos % BLOCK_SIZE) * stride_ks
        k = tl.load(
            k_head + slot[None, :] + offs_d[:, None] * stride_kd,
            mask=d_ok[:, None] & kv_ok[None, :],
            other=0.0,
        )  # [HEAD_DIM_P, TILE_N]
        if KV_FP8:
            k = k.to(q.dtype)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=PRECISION)
        else:
            s = tl.dot(q, k, input_precision=PRECISION)
        s = s * qk_scale
        visible = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= limit[:, None])
        if SLIDING:
            visible = visible & (kv_pos[None, :] > limit[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        vslot = blk * stride_vb + (kv_pos % BLOCK_SIZE) * stride_vs
        v = tl.load(
            v_head + vslot[:, None] + offs_d[None, :] * stride_vd,
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_P]
        if KV_FP8:
            v = v.to(q.dtype)
        p = p.to(v.dtype)
        if UPCAST_DOT:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p, v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale

    if NUM_SPLITS > 1:
        row_base = (tok * num_q_heads + head) * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + row_base[:, None] * HEAD_DIM_P + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + row_base * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row_base * 2 + 1, l_i, mask=row_ok)
    else:
        store_rows(out_ptr, acc, l_i, tok, head, offs_d, stride_ot, stride_oh, stride_od,
                   row_ok[:, None] & d_ok[None, :])  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    split_decode_rows: bool = False,
    sliding_window: int | None = None,
    prologue: AttentionPrologue | None = None,
) -> torch.Tensor:
    """q [T, Hq, D]; caches [num_blocks, block_size, Hk, D] (any strides);
    block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (keys after
    this step); cu_seqlens_q [num_seqs + 1] int32. Returns [T, Hq, D] in q's dtype.
    FP8 caches are read as stored * k_scale / v_scale (None: 1.0).
    split_decode_rows (with max_query_len > 1): two launches, the one-query rows at a
    decode configuration and the longer ones at this batch's; a single configuration
    sized for long queries gives each decode row a whole prefill tile (mostly idle).
    Lengths stay on the device: both grids cover every sequence and skip the others'.
    sliding_window: row p sees keys p - sliding_window < k <= p (None: all k <= p).
    prologue: q as the qkv projection left it, rope_and_store_kv done in this launch
    (attention_prologue.py); a batch of decode rows and a power-of-two head_dim only."""
    kv_fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    n_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError("cache shapes must be [num_blocks, block_size, Hk, D] matching q")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if n_tokens == 0 or num_seqs == 0:
        return out
    check_device(_paged_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    if prologue is not None:
        if not prologue_fits(head_dim, max_query_len):
            raise ValueError(
                f"the attention prologue takes decode rows only (max_query_len {max_query_len}) "
                f"and a power-of-two head_dim ({head_dim})"
            )
        check_device(_paged_attention_kernel, prologue.k, prologue.positions, prologue.slot_mapping)
    pro_args, pro_consts = prologue_args(prologue, q, k_cache, kv_fp8, k_scale)
    interp = is_interpreted(_paged_attention_kernel)
    smem = (head_dim, q.element_size(), k_cache.element_size(), device_smem(q) or 0)
    sizes = (n_tokens, num_seqs, num_q_heads, num_kv_heads)
    # a forced key-split count keeps one launch (the merge would cover every row)
    split = split_decode_rows and max_query_len > 1 and num_splits in (None, 1)
    # sized for the keys one q block walks: with a window, window + max_query_len - 1
    kv_span = min(max_seq_len, (sliding_window or max_seq_len) + max_query_len - 1)
    cfg = attention_config(
        *sizes,
        max_query_len,
        kv_span,
        device_sms(q),
        interp,
        1 if split else num_splits,
        config,
        smem=smem,
        kv_fp8=kv_fp8,
    )
    launches = [(0, cfg)]
    if split:
        decode = attention_config(
            *sizes, 1, kv_span, device_sms(q), interp, 1, smem=smem, kv_fp8=kv_fp8
        )
        launches = [(1, decode), (2, cfg)]
    head_dim_p = max(16, next_pow2(head_dim))
    splits = cfg["NUM_SPLITS"]
    if splits > 1:
        part_acc = torch.empty(
            n_tokens, num_q_heads, splits, head_dim_p, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            n_tokens, num_q_heads, splits, 2, dtype=torch.float32, device=q.device
        )
    else:
        part_acc = part_ml = out  # unused
    # fp32 compute: exact fp32 products (no tf32); 16-bit: the target default
    compute_dtype = q.dtype if kv_fp8 else k_cache.dtype
    precision = "ieee" if compute_dtype == torch.float32 else None
    kv_f16 = kv_fp8 and q.dtype != torch.float32
    qk_scale = _LOG2E if kv_f16 else float(scale) * _LOG2E
    if kv_fp8 and k_scale is not None:
        qk_scale *= float(k_scale)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, cu_seqlens_q = seq_lens.contiguous(), cu_seqlens_q.contiguous()
    pdl = use_pdl(q)
    for rows, c in launches:
        _paged_attention_kernel[(c["num_q_blocks"], num_kv_heads, c["NUM_SPLITS"])](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            part_acc,
            part_ml,
            qk_scale,
            float(scale),
            1.0 if v_scale is None else float(v_scale),
            sliding_window or 0,
            num_seqs,
            num_q_heads,
            *q.stride(),
            *out.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            block_tables.stride(0),
            *pro_args,
            Q_PER_KV=num_q_heads // num_kv_heads,
            BLOCK_Q=c["BLOCK_Q"],
            BLOCK_M=c["BLOCK_M"],
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            BLOCK_SIZE=block_size,
            TILE_N=c["TILE_N"],
            NUM_SPLITS=c["NUM_SPLITS"],
            PRECISION=precision,
            UPCAST_DOT=interp and compute_dtype == torch.bfloat16,
            KV_FP8=kv_fp8,
            KV_F16=kv_f16,
            ROWS=rows,
            SLIDING=sliding_window is not None,
            USE_PDL=pdl,
            **pro_consts,
            num_warps=c["num_warps"],
            num_stages=c["num_stages"],
            launch_pdl=pdl,
        )
    if splits > 1:
        n_rows = n_tokens * num_q_heads
        block_r = min(next_pow2(n_rows), 64) if interp else 1
        merge_splits_kernel[(triton.cdiv(n_rows, block_r),)](
            out,
            part_acc,
            part_ml,
            n_rows,
            num_q_heads,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=splits,
            BLOCK_R=block_r,
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out


__all__ = ["attention_config", "paged_attention"]
