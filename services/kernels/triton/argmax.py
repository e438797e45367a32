"""Greedy sampling's argmax over a vocabulary row, in two stages.

torch's argmax of one 128k-vocabulary row took 37-40 us of an H100's decode step
(docs/performance.md, the engine's kernels without PDL): one row is one output, too
little parallel work for its reduction. Here each row is cut into chunks, a program
per (row, chunk) reduces its chunk to (first maximum, its index) and one program per
row picks the first chunk holding the row's maximum, so a batch-1 row is read by
dozens of programs at once.

Same answer as torch.argmax, ties and NaN included: the first index of the maximum,
or of the first NaN when the row has one (torch ranks NaN above every number)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import check_device, is_interpreted, next_pow2

CHUNK = 2048  # elements a first-stage program reduces (4 KB of bf16 logits)


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, stride_row, vocab, part_val_ptr, part_idx_ptr, num_chunks,
    CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < vocab
    x = tl.load(logits_ptr + row * stride_row + offs, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    nan = x != x
    big = vocab + CHUNK  # above every index: "none here"
    first_nan = tl.min(tl.where(nan & ok, offs, big), axis=0)
    best = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    first_best = tl.min(tl.where(ok & (x == best), offs, big), axis=0)
    has_nan = first_nan < big
    # a NaN outranks every number: the chunk reports it as +inf with the NaN's index,
    # and part_val's NaN flag (below) tells the second stage it was a NaN
    val = tl.where(has_nan, float("inf"), best)
    idx = tl.where(has_nan, first_nan, tl.where(first_best < big, first_best, chunk * CHUNK))
    slot = row * num_chunks * 2 + chunk * 2
    tl.store(part_val_ptr + slot, val)
    tl.store(part_val_ptr + slot + 1, has_nan.to(tl.float32))
    tl.store(part_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _pick_chunk_kernel(
    part_val_ptr, part_idx_ptr, out_ptr, num_chunks, CHUNKS_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P)
    ok = c < num_chunks
    base = part_val_ptr + row * num_chunks * 2 + c * 2
    val = tl.load(base, mask=ok, other=float("-inf"))
    nan = tl.load(base + 1, mask=ok, other=0.0) > 0.0
    idx = tl.load(part_idx_ptr + row * num_chunks + c, mask=ok, other=0)
    big = num_chunks
    first_nan = tl.min(tl.where(nan, c, big), axis=0)
    best = tl.max(val, axis=0)
    first_best = tl.min(tl.where(ok & (val == best), c, big), axis=0)
    pick = tl.where(first_nan < big, first_nan, tl.where(first_best < big, first_best, 0))
    tl.store(out_ptr + row, tl.sum(tl.where(c == pick, idx, 0), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (fp32, bf16 or fp16; rows contiguous) -> int64 [rows]:
    torch.argmax(logits, dim=-1)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax of an empty vocabulary")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    check_device(_chunk_argmax_kernel, logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunk = min(CHUNK, next_pow2(vocab))
    if is_interpreted(_chunk_argmax_kernel):
        chunk = min(chunk, 256)  # several chunks a row even for the tests' small vocabularies
    num_chunks = triton.cdiv(vocab, chunk)
    part_val = torch.empty(rows, num_chunks, 2, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, logits.stride(0), vocab, part_val, part_idx, num_chunks, CHUNK=chunk,
        num_warps=4,
    )  # fmt: skip
    _pick_chunk_kernel[(rows,)](
        part_val, part_idx, out, num_chunks, CHUNKS_P=next_pow2(num_chunks), num_warps=4
    )
    return out
