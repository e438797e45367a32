"""The sdpa attention candidate (FlashAttention varlen on CUDA, per-sequence SDPA
elsewhere) against the torch reference, on the same ragged batches as the triton
kernel: prompt-only batches, chunks after cached prefixes next to decode rows, GQA,
shuffled block tables over strided per-layer views of the block-major cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.kernels.sdpa_backend import SdpaBackend
from tests.kernels.helpers import (
    DTYPES,
    assert_close_rel,
    make_attention_batch,
    reference_attention,
)

BATCHES = {
    "prompts": ([12, 40, 3], [0, 0, 0]),
    "chunks_after_prefix_with_decodes": ([1, 1, 37, 5, 1, 16], [40, 3, 20, 0, 70, 32]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("heads", [(8, 2, 32), (4, 4, 16)], ids=["gqa", "mha"])
def test_sdpa_matches_reference(dtype, batch, heads, device):
    hq, hk, d = heads
    q, k_cache, v_cache, meta, kv = make_attention_batch(
        *BATCHES[batch],
        block_size=16,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=dtype,
        device=device,
    )
    kv_before = kv.clone()
    backend = SdpaBackend()
    backend.prepare_attention(meta)
    out = backend.paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, d**-0.5), dtype)
    assert torch.equal(kv, kv_before), "attention wrote to the cache"


def test_sdpa_needs_host_lengths(device):
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [4],
        [0],
        block_size=16,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=device,
    )
    graph_like = dataclasses.replace(meta, cu_seqlens_q_cpu=None, seq_lens_cpu=None)
    with pytest.raises(ValueError, match="host sequence lengths"):
        SdpaBackend().paged_attention(q, k_cache, v_cache, graph_like, 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
def test_flash_varlen_path_is_used_on_cuda():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    assert SdpaBackend().uses_varlen(q), "torch here has no usable varlen_attn"
