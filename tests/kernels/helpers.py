"""Shared builders and error metrics for the kernel tests."""

from __future__ import annotations

import torch

from services.kernels.interface import AttentionMetadata

# Relative (Frobenius) error bounds against an fp32 reference computed from the same
# (already rounded) inputs: a few roundings to the output dtype, plus the bf16 / fp16
# softmax probabilities that flash-style attention feeds to the second matmul.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale=1.0) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), "non-finite values"
    err = rel_err(out, ref)
    bound = REL_TOL[dtype] * scale
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g} ({dtype})"


def make_attention_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    num_layers: int = 3,
    layer: int = 1,
    spare_blocks: int = 7,
    seed: int = 0,
):
    """A ragged batch: sequence i has ctx_lens[i] cached tokens and q_lens[i] new rows
    (decode rows: q_len 1). The cache is the engine's block-major tensor
    [num_blocks, num_layers, 2, block_size, Hk, D] and k/v caches are strided views of
    one layer of it; block tables are shuffled (non-contiguous) and zero-padded."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    width = max(blocks_per_seq) + 1  # at least one padding column
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv = torch.randn(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen
    ).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_q_heads, head_dim, generator=gen).to(dtype)
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, c, n in zip(tables, ctx_lens, q_lens)
        for p in range(c, c + n)
    ]
    dev = torch.device(device)
    kv = kv.to(dev)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=list(seq_lens),
    )
    return q.to(dev), kv[:, layer, 0], kv[:, layer, 1], meta, kv


def reference_attention(q, k_cache, v_cache, meta, scale, sliding_window=None) -> torch.Tensor:
    """The torch backend in fp32 on the same inputs (fresh metadata, no shared cache)."""
    from services.kernels.torch_backend import TorchBackend

    fresh = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
    )
    return TorchBackend().paged_attention(
        q.float(), k_cache.float(), v_cache.float(), fresh, scale, sliding_window=sliding_window
    )
