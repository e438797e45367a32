"""Flash-decoding's second half: merging a q block's key-split partials (attention.py).

Two ways, chosen per call: a second kernel over every row after the attention kernel
(`merge_splits_kernel`), or inside the attention kernel by the last split of each q
block to finish (`merge_rows`, MERGE_LAST), which saves a launch and its wait per
layer. The last split is known by an arrival counter per q block (`merge_counters`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import pdl_sync


@triton.jit
def merge_rows(
    out_ptr, part_acc_ptr, part_ml_ptr, tok, head, row_ok, offs_d, stride_ot, stride_oh,
    stride_od, num_q_heads, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """MERGE_LAST: one q block's rows [BLOCK_M] from every split's partial, a split at a
    time (all of them at once would not fit the registers), rescaled as the running max
    grows (as the attention loop does), so each partial is read once. The partials come
    from other programs' stores: read past L1 (.cg), which may hold an earlier launch's."""
    rows = (tok * num_q_heads + head) * NUM_SPLITS  # [BLOCK_M] first split's index
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.load(part_ml_ptr + (rows + s) * 2, mask=row_ok, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
        lsum = tl.load(part_ml_ptr + (rows + s) * 2 + 1, mask=row_ok, other=0.0,
                       cache_modifier=".cg")  # fmt: skip
        part = tl.load(part_acc_ptr + (rows + s)[:, None] * HEAD_DIM_P + offs_d[None, :],
                       mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, m)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far: weights 0
        alpha = tl.math.exp2(m_run - m_use)
        w = tl.math.exp2(m - m_use)  # an empty split: exp2(-inf) = 0
        denom = denom * alpha + w * lsum
        acc = acc * alpha[:, None] + part * w[:, None]
        m_run = m_new
    store_rows(out_ptr, acc, denom, tok, head, offs_d, stride_ot, stride_oh, stride_od,
               row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])  # fmt: skip


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


def merge_counters(workspace: dict | None, size: int, device) -> torch.Tensor:
    """MERGE_LAST's arrival counters: zero at the start of every launch. Each launch
    leaves them zero (the last split resets its q block's), so one zeroed tensor serves
    every layer of a step; inside a captured graph its zeroing is part of the graph."""
    counters = None if workspace is None else workspace.get("attention_merge_counters")
    if counters is None or counters.numel() < size:
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        if workspace is not None:
            workspace["attention_merge_counters"] = counters
    return counters
