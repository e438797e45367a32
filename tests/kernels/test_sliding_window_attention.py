"""Sliding-window paged attention (a query at position p sees keys p - window < k <= p,
transformers' sliding_window_overlay): the torch reference against a dense per-sequence
oracle, then the triton kernel, its split-K decode path and the sdpa backend against the
reference on ragged batches of decode rows and prefill chunks, with windows smaller
than a block, around a block and longer than every context."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.sdpa_backend import SdpaBackend  # noqa: E402
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import (  # noqa: E402
    assert_close_rel,
    make_attention_batch,
    reference_attention,
)

# (query_len, cached context): decode rows, chunks after unaligned and aligned prefixes,
# a first chunk; as in test_paged_attention.py
MIXED = ([1, 1, 37, 5, 1, 16], [40, 3, 20, 0, 70, 32])
WINDOWS = [1, 7, 16, 40, 500]  # below a block, one block, a few, beyond every context


def dense_window_attention(q, k_cache, v_cache, meta, scale, window):
    """Each sequence's keys gathered in order and attended densely in fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    cu, lens, bs = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist(), meta.block_size
    groups = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[i].long().cpu()[pos // bs]
        k = k_cache.cpu()[blocks, pos % bs].double().repeat_interleave(groups, dim=1)
        v = v_cache.cpu()[blocks, pos % bs].double().repeat_interleave(groups, dim=1)
        rows = q.cpu()[cu[i] : cu[i + 1]].double()
        p = torch.arange(seq_len - rows.shape[0], seq_len).unsqueeze(1)  # absolute positions
        visible = (pos <= p) & (pos > p - window)  # [rows, keys]
        s = torch.einsum("qhd,khd->hqk", rows, k) * scale
        s = s.masked_fill(~visible, float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def batch(q_lens, ctx, *, dtype=torch.float32, block_size=16, device="cpu", seed=0, d=32):
    return make_attention_batch(
        q_lens,
        ctx,
        block_size=block_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype=dtype,
        device=device,
        seed=seed,
    )[:4]


@pytest.mark.parametrize("window", WINDOWS)
def test_torch_reference_is_the_dense_window(window):
    q, k_cache, v_cache, meta = batch(*MIXED)
    out = TorchBackend().paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
    assert_close_rel(out, dense_window_attention(q, k_cache, v_cache, meta, 0.2, window), q.dtype)
    full = reference_attention(q, k_cache, v_cache, meta, 0.2)
    assert torch.equal(out, full) == (window >= meta.max_seq_len)


def test_torch_decode_rows_without_a_causal_mask_still_get_the_window():
    # decode rows that all see their whole padded context skip the causal mask; layers
    # with and without a window share the step's metadata (one mask per window)
    q, k_cache, v_cache, meta = batch([1, 1, 1], [39, 39, 39], seed=1)
    backend = TorchBackend()
    backend.prepare_attention(meta)
    assert meta.backend_data["torch"][-1] is None  # the no-mask fast path
    full = backend.paged_attention(q, k_cache, v_cache, meta, 0.2)
    for window in (8, 3, 8):
        out = backend.paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
        want = dense_window_attention(q, k_cache, v_cache, meta, 0.2, window)
        assert_close_rel(out, want, q.dtype)
    assert sorted(meta.backend_data["torch_windows"]) == [3, 8]
    assert torch.equal(backend.paged_attention(q, k_cache, v_cache, meta, 0.2), full)


@pytest.mark.parametrize("splits", [None, 4], ids=["one_pass", "split_kv"])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_mixed_batch(window, splits, device):
    q, k_cache, v_cache, meta = batch(*MIXED, device=device)
    out = TritonBackend(attn_num_splits=splits).paged_attention(
        q, k_cache, v_cache, meta, 32**-0.5, sliding_window=window
    )
    ref = reference_attention(q, k_cache, v_cache, meta, 32**-0.5, sliding_window=window)
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_16bit_and_block_size_one(dtype, device):
    q, k_cache, v_cache, meta = batch(*MIXED, dtype=dtype, block_size=1, device=device, seed=2)
    out = TritonBackend().paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=9)
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.2, 9), dtype)


@pytest.mark.parametrize("window", [7, 40])
def test_triton_split_k_decode(window, device):
    # decode rows only, keys split 8 ways: most splits of a short window walk are empty
    # and must merge as zero weight
    q, k_cache, v_cache, meta = batch([1] * 5, [0, 1, 15, 100, 63], device=device, seed=3, d=16)
    ref = reference_attention(q, k_cache, v_cache, meta, 0.25, sliding_window=window)
    for splits in (1, 8):
        out = TritonBackend(attn_num_splits=splits).paged_attention(
            q, k_cache, v_cache, meta, 0.25, sliding_window=window
        )
        assert_close_rel(out, ref, torch.float32)


def test_triton_long_prefill_starts_later_q_blocks_past_the_window(device):
    # a 130-row chunk after a 20-token prefix: BLOCK_M 128, several q blocks, each
    # starting its key walk at its own first visible tile
    q, k_cache, v_cache, meta = batch([130, 1], [20, 7], device=device, seed=4, d=16)
    out = TritonBackend().paged_attention(q, k_cache, v_cache, meta, 0.25, sliding_window=50)
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.25, 50), torch.float32)


def test_triton_split_rows_in_a_captured_mixed_layout(device):
    # lengths on the device only, max_query_len / max_seq_len upper bounds, empty
    # sequence slots; decode rows and chunks in two launches (split_decode_rows)
    from services.kernels import triton as tk

    q, k_cache, v_cache, meta = batch(*MIXED, device=device, seed=5)
    ref = reference_attention(q, k_cache, v_cache, meta, 32**-0.5, sliding_window=10)
    empty = 3
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(empty)])
    lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(empty)])
    tables = torch.cat(
        [meta.block_tables, meta.block_tables.new_zeros(empty, meta.block_tables.shape[1])]
    )
    for split in (True, False):
        out = tk.paged_attention(
            q, k_cache, v_cache, tables, lens, cu, max_query_len=64, max_seq_len=4096,
            scale=32**-0.5, split_decode_rows=split, sliding_window=10,
        )  # fmt: skip
        assert_close_rel(out, ref, torch.float32)


def test_triton_refuses_a_window_below_one(device):
    q, k_cache, v_cache, meta = batch([1], [4], device=device)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        TritonBackend().paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=0)


@pytest.mark.parametrize("window", [3, 16, 500])
def test_sdpa_per_sequence_path(window):
    q, k_cache, v_cache, meta = batch(*MIXED, seed=6)
    out = SdpaBackend().paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.2, window), q.dtype)


# ---- on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 1024])
@pytest.mark.parametrize(
    "shape",
    [([1] * 2, [4000, 1500]), ([512, 1, 1, 300], [1024, 2047, 10, 0])],
    ids=["decode2_long", "mixed"],
)
def test_triton_llama3_8b_shapes(shape, window):
    # compiled, with the split count the GPU picks (decode2_long: split-K)
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        *shape, block_size=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, device="cuda", num_layers=2, seed=7,
    )  # fmt: skip
    out = TritonBackend().paged_attention(
        q, k_cache, v_cache, meta, 128**-0.5, sliding_window=window
    )
    ref = reference_attention(q, k_cache, v_cache, meta, 128**-0.5, sliding_window=window)
    assert_close_rel(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 37, 500])
def test_sdpa_flash_varlen_window(window):
    backend = SdpaBackend()
    q, k_cache, v_cache, meta = batch(*MIXED, dtype=torch.bfloat16, device="cuda", seed=8)
    assert backend.uses_varlen(q)
    out = backend.paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
    ref = reference_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
    assert_close_rel(out, ref, torch.bfloat16)
