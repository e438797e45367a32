"""Flash-decoding's second half: merging a q block's key-split partials (attention.py),
in a second kernel over the query rows (one head of one token each).

Merging inside the attention kernel instead, by each q block's last split to finish
(an arrival counter per q block), was built and timed on an H100: the attention
kernel went from 5.6 + 2.7 us (this kernel) to 21.5 us a Qwen3-30B-A3B layer, and
every split count and load grouping tried was slower (docs/performance.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from services.kernels.triton._launch import pdl_sync


@triton.jit
def store_rows(out_ptr, acc, denom, tok, head, offs_d, stride_ot, stride_oh, stride_od, mask):
    """acc [rows, D] / denom [rows] (0: an empty row, stored as 0) into out[tok, head]."""
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(
        out_ptr
        + tok[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit(do_not_specialize=["n_rows"])
def merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    n_rows,  # T * Hq
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # token * Hq + head
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    base = rows64[:, None] * NUM_SPLITS + splits[None, :]  # [R, S]
    m = tl.load(part_ml_ptr + base * 2, mask=row_ok[:, None], other=float("-inf"))
    lsum = tl.load(part_ml_ptr + base * 2 + 1, mask=row_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max[:, None])  # empty splits: exp2(-inf) = 0
    denom = tl.sum(w * lsum, axis=1)
    acc = tl.load(
        part_acc_ptr + base[:, :, None] * HEAD_DIM_P + offs_d[None, None, :],
        mask=row_ok[:, None, None],
        other=0.0,
    )  # [R, S, D]
    store_rows(out_ptr, tl.sum(acc * w[:, :, None], axis=1), denom, rows64 // num_q_heads,
               rows64 % num_q_heads, offs_d, stride_ot, stride_oh, stride_od,
               row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])  # fmt: skip
