"""The engine's KV cache as the transfer layer sees it: a layout and one registered
memory region. Lives at the service edge so the engine and kvtransfer stay unaware of
each other."""

from __future__ import annotations

import contextlib

import torch

from kvtransfer import KVConnector, KVLayout


def kv_layout(kv_cache: torch.Tensor, spec) -> KVLayout:
    """spec: the model runner's KVCacheSpec; kv_cache: this rank's block-head-major
    tensor [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]."""
    return KVLayout(
        num_blocks=kv_cache.shape[0],
        block_size=spec.block_size,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=str(spec.dtype).removeprefix("torch."),
        layout="block_head_major",
        k_scales=spec.k_scales,
        v_scales=spec.v_scales,
        # a spec without TP fields is a single rank holding every head
        tp_size=getattr(spec, "tp_size", 1),
        tp_rank=getattr(spec, "tp_rank", 0),
        total_kv_heads=getattr(spec, "total_kv_heads", spec.num_kv_heads),
    )


def memory_location(kv_cache: torch.Tensor) -> str:
    return f"cuda:{kv_cache.device.index}" if kv_cache.is_cuda else "*"


def register_kv_cache(connector: KVConnector, kv_cache: torch.Tensor, spec) -> None:
    # Mooncake registers GPU memory on the current device
    device = torch.cuda.device(kv_cache.device) if kv_cache.is_cuda else contextlib.nullcontext()
    with device:
        connector.register(
            kv_cache.data_ptr(),
            kv_cache.numel() * kv_cache.element_size(),
            kv_layout(kv_cache, spec),
        )
