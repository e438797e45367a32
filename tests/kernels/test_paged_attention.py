"""The triton paged-attention kernel against the torch reference (fp32, same inputs) on
ragged batches that mix decode rows with chunked-prefill rows reading cached prefix
blocks: shuffled (non-contiguous) block tables, block sizes 16 and 1, GQA, and caches
that are strided per-layer views of the engine's block-major KV tensor."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.triton import attention_config  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import (  # noqa: E402
    DTYPES,
    assert_close_rel,
    make_attention_batch,
    reference_attention,
)

# (query_len, cached context) per sequence: decode rows (q 1) with short and long
# contexts, a chunk after a cached prefix that is not block aligned, a first chunk
# (no context), a chunk that starts exactly on a block boundary.
MIXED = ([1, 1, 37, 5, 1, 16], [40, 3, 20, 0, 70, 32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("splits", [None, 4], ids=["one_pass", "split_kv"])
def test_mixed_decode_and_chunked_prefill(dtype, block_size, splits, device):
    q, k_cache, v_cache, meta, kv = make_attention_batch(
        *MIXED,
        block_size=block_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        device=device,
    )
    assert not k_cache.is_contiguous()  # a layer's view of the block-major cache
    kv_before = kv.clone()
    backend = TritonBackend(attn_num_splits=splits)
    backend.prepare_attention(meta)
    out = backend.paged_attention(q, k_cache, v_cache, meta, scale=32**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 32**-0.5), dtype)
    assert torch.equal(kv, kv_before), "attention wrote to the cache"


@pytest.mark.parametrize(
    "heads",
    [(4, 4, 16), (6, 2, 24), (16, 1, 16)],
    ids=["mha", "gqa3_d24", "mqa16"],
)
def test_head_layouts(heads, device):
    hq, hk, d = heads
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [3, 1, 9],
        [5, 17, 16],
        block_size=16,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=torch.float16,
        device=device,
        seed=1,
    )
    out = TritonBackend().paged_attention(q, k_cache, v_cache, meta, scale=0.3)
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.3), torch.float16)


def test_decode_only_batch_and_uneven_splits(device):
    # All rows decode (max_query_len 1): the flash-decoding layout, with more splits
    # than some sequences have key tiles (empty splits must merge as zero weight).
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [1] * 5,
        [0, 1, 15, 100, 63],
        block_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=device,
        seed=2,
    )
    ref = reference_attention(q, k_cache, v_cache, meta, 0.25)
    for splits in (1, 8):
        out = TritonBackend(attn_num_splits=splits).paged_attention(
            q, k_cache, v_cache, meta, scale=0.25
        )
        assert_close_rel(out, ref, torch.float32)


def test_long_prefill_uses_large_tiles(device):
    # one 130-row chunk after a 20-token prefix: BLOCK_M 128 path, several q blocks
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [130, 1],
        [20, 7],
        block_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=device,
        seed=3,
    )
    assert attention_config(131, 2, 4, 2, 130, 150, 8, True)["BLOCK_M"] == 128
    out = TritonBackend().paged_attention(q, k_cache, v_cache, meta, scale=0.25)
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.25), torch.float32)


def test_config_is_shape_only():
    # The grid depends on shapes and host ints only (no device->host sync), and a
    # small decode batch on a big GPU is split across the key range.
    cfg = attention_config(4, 4, 32, 8, 1, 4096, 132, interpreted=False)
    assert cfg["BLOCK_M"] == 16 and cfg["BLOCK_Q"] == 4 and cfg["NUM_SPLITS"] > 1
    cfg = attention_config(8 * 2048, 8, 32, 8, 2048, 2048, 132, interpreted=False)
    assert cfg["BLOCK_M"] == 128 and cfg["NUM_SPLITS"] == 1
    assert cfg["num_q_blocks"] == 8 * 2048 // cfg["BLOCK_Q"] + 8


def test_long_fp8_decode_walks_take_four_warps():
    # 128 sequences x 4k keys: bf16 walks take 8 warps, FP8 ones (tiles converted in
    # registers) 4 warps and a deeper pipeline, as the H200 sweep measured
    args = (128, 128, 32, 8, 1, 4096, 132)
    bf16 = attention_config(*args, interpreted=False)
    fp8 = attention_config(*args, interpreted=False, kv_fp8=True)
    assert (bf16["TILE_N"], bf16["num_warps"], bf16["num_stages"]) == (128, 8, 2)
    assert (fp8["TILE_N"], fp8["num_warps"], fp8["num_stages"]) == (128, 4, 3)


def test_config_fits_the_gpus_shared_memory():
    # fp32 at head_dim 128, a 2k prefill: the bf16 tiles (BLOCK_M 128, TILE_N 64, 3
    # stages) would need 257 KiB of the H200's 227; the tiles shrink until they fit,
    # and what fits is left alone
    h200 = 232448
    args = (8 * 2048, 8, 32, 8, 2048, 2048, 132)
    bf16 = attention_config(*args, interpreted=False, smem=(128, 2, 2, h200))
    assert bf16 == attention_config(*args, interpreted=False)
    fp32 = attention_config(*args, interpreted=False, smem=(128, 4, 4, h200))
    need = 128 * (fp32["BLOCK_M"] * 4 + fp32["num_stages"] * 2 * fp32["TILE_N"] * 4) + 1024
    assert need <= h200 and fp32["BLOCK_M"] >= 16
    assert fp32["num_q_blocks"] == 8 * 2048 // fp32["BLOCK_Q"] + 8
    # explicit tiles are the caller's: kept even when they overflow
    pinned = dict(BLOCK_M=128, TILE_N=64, num_stages=3)
    cfg = attention_config(*args, False, None, pinned, smem=(128, 4, 4, h200))
    assert (cfg["BLOCK_M"], cfg["TILE_N"], cfg["num_stages"]) == (128, 64, 3)


# ---- Llama-3-8B shapes on a GPU ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "batch",
    [
        ([1] * 64, [1023] * 64),  # decode, batch 64, 1k context
        ([1] * 2, [4000, 1500]),  # small decode batch, long contexts: split-KV
        ([512, 1, 1, 300], [1024, 2047, 10, 0]),  # chunked prefill mixed with decode
    ],
    ids=["decode64", "decode2_long", "mixed"],
)
def test_llama3_8b_shapes(dtype, batch):
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        *batch,
        block_size=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device="cuda",
        num_layers=2,
        seed=4,
    )
    out = TritonBackend().paged_attention(q, k_cache, v_cache, meta, scale=128**-0.5)
    ref = reference_attention(q, k_cache, v_cache, meta, 128**-0.5)
    assert_close_rel(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "captured,replayed",
    [
        # decode batch (split-KV path): longer contexts at replay
        (([1] * 4, [100, 30, 500, 7]), ([1] * 4, [900, 64, 1000, 300])),
        # mixed batch: same token count, different query/context split at replay
        (([1, 1, 6], [20, 5, 100]), ([3, 3, 2], [50, 10, 200])),
    ],
    ids=["decode", "mixed"],
)
def test_cuda_graph_replay_with_new_metadata(captured, replayed):
    """The launch depends on shapes only: a step captured in a CUDA graph replays
    correctly after the metadata tensors are rewritten in place for another batch."""
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        *replayed,
        block_size=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        seed=5,
    )
    expected = reference_attention(q, k_cache, v_cache, meta, 128**-0.5)
    want_cu, want_lens = meta.cu_seqlens_q.clone(), meta.seq_lens.clone()
    q_lens, ctx = captured
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta.cu_seqlens_q.copy_(torch.tensor(cu, dtype=torch.int32))
    meta.seq_lens.copy_(torch.tensor([a + b for a, b in zip(q_lens, ctx)], dtype=torch.int32))
    meta.max_query_len, meta.max_seq_len = max(q_lens), max(a + b for a, b in zip(q_lens, ctx))
    backend = TritonBackend()
    backend.prepare_attention(meta)
    static_q = q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.paged_attention(static_q, k_cache, v_cache, meta, 128**-0.5)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.paged_attention(static_q, k_cache, v_cache, meta, 128**-0.5)
    meta.cu_seqlens_q.copy_(want_cu)
    meta.seq_lens.copy_(want_lens)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, expected, torch.bfloat16)


@pytest.mark.parametrize("split", [True, False], ids=["split_rows", "one_config"])
def test_captured_mixed_step_layout(split, device):
    """As a captured mixed step runs it (services/engine/mixed_graph.py): lengths known
    only on the device, max_query_len and max_seq_len upper bounds, empty sequence
    slots after the real ones; with split_decode_rows the decode rows take a decode
    launch and the chunks a prefill one. Both equal the reference."""
    from services.kernels import triton as tk

    dtype = torch.float32
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        *MIXED,
        block_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        device=device,
    )
    ref = reference_attention(q, k_cache, v_cache, meta, 32**-0.5)
    empty = 3  # sequence slots with no query rows
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(empty)])
    lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(empty)])
    tables = torch.cat(
        [meta.block_tables, meta.block_tables.new_zeros(empty, meta.block_tables.shape[1])]
    )
    out = tk.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        cu,
        max_query_len=64,
        max_seq_len=4096,
        scale=32**-0.5,
        split_decode_rows=split,
    )
    assert_close_rel(out, ref, dtype)
