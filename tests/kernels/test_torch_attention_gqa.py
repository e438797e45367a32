"""The torch backend's paged attention on a CPU in 16-bit dtypes folds each KV head's
query heads into its query rows (faster than SDPA's enable_gqa there): the fold maps
heads as enable_gqa does, and the attention equals the fp32 reference on ragged batches
of decode rows and chunked prefills, masked and unmasked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.torch_backend import TorchBackend, _grouped_query_attention
from tests.kernels.helpers import assert_close_rel, make_attention_batch, reference_attention

MIXED = ([1, 1, 37, 5, 1, 16], [40, 3, 20, 0, 70, 32])  # decode rows and chunks
DECODE_EQUAL = ([1, 1, 1], [33, 33, 33])  # every row sees its whole context: no mask
DECODE_RAGGED = ([1, 1, 1, 1], [5, 80, 17, 40])


@pytest.mark.parametrize("q_len", [1, 7])
@pytest.mark.parametrize("masked", [False, True])
def test_the_fold_maps_heads_as_enable_gqa(q_len, masked):
    gen = torch.Generator().manual_seed(1)
    b, hk, groups, k_len, d = 3, 3, 3, 19, 16
    query = torch.randn(b, hk * groups, q_len, d, generator=gen)
    keys = torch.randn(b, hk, k_len, d, generator=gen)
    values = torch.randn(b, hk, k_len, d, generator=gen)
    mask = None
    if masked:  # causal over the last q_len positions, per sequence lengths
        lens = torch.tensor([k_len, 11, 15])
        pos = (lens - q_len).view(-1, 1) + torch.arange(q_len).view(1, -1)
        kv_pos = torch.arange(k_len).view(1, 1, -1)
        mask = ((kv_pos <= pos.unsqueeze(-1)) & (kv_pos < lens.view(-1, 1, 1))).unsqueeze(1)
    expected = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    out = _grouped_query_attention(query, keys, values, mask, 0.3, groups)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch", [MIXED, DECODE_EQUAL, DECODE_RAGGED], ids=["mixed", "equal", "ragged"]
)
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 2, 32), (4, 4, 32)], ids=["smollm2", "gqa4", "mha"]
)
def test_16_bit_attention_on_cpu_equals_the_fp32_reference(dtype, batch, heads):
    hq, hk, d = heads
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        *batch,
        block_size=16,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=dtype,
        device="cpu",
    )
    backend = TorchBackend()
    backend.prepare_attention(meta)
    out = backend.paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, d**-0.5), dtype)
