"""What a KV cache block holds, as the runner allocates it and the transfer layer
registers it (services/common/kv.py): the block-head-major layout's dimensions and,
for an FP8 cache, the per-layer scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the cache's: the model's, or float8_e4m3fn
    # FP8 cache: each layer's K and V scale (stored = value / scale); empty otherwise
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    # tensor parallelism: this rank holds num_kv_heads of the model's total_kv_heads
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0

    @property
    def block_bytes(self) -> int:
        elem = self.dtype.itemsize
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem
