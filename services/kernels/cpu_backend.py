"""`cpu_slab`: a CPU candidate for the kernel tuner. Linear layers run as one batched
matmul over column slabs of the weight, one slab per intra-op thread; every other op
is the torch reference's.

Why a candidate and not the default: a few rows times a weight is a matrix-vector
product, and on a 2-core AMD EPYC oneDNN/MKL ran it on one thread at ~13 GB/s, so the
slabs (every thread streams its share) took SmolLM2's layers at batch 1 from 36 to
21 ms and the LM head from 10 to 4 ms. On a 2-core Intel Xeon with AVX-512 and AMX the
plain GEMM was as fast and 16 equal requests ran slower with slabs than transformers'
own batch (issue 21). Which one wins depends on the CPU, so the tuner measures both
per shape class on the machine that runs them."""

from __future__ import annotations

import torch

from services.kernels.fp8 import fp8_format_of
from services.kernels.torch_backend import TorchBackend


def column_slabs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> [parts, in, out / parts]: x @ slabs[p] is output columns
    p * out / parts onward. One part per intra-op thread (fewer if out does not split)."""
    out_features = weight.shape[0]
    parts = max(1, torch.get_num_threads())
    while out_features % parts:
        parts -= 1
    return (
        weight.t()
        .reshape(weight.shape[1], parts, out_features // parts)
        .transpose(0, 1)
        .contiguous()
    )


class CpuSlabBackend(TorchBackend):
    name = "cpu_slab"

    def linear(self, x, layer):
        if fp8_format_of(layer) is not None or x.dim() != 2 or x.device.type != "cpu":
            return super().linear(x, layer)
        # built once per layer (a second copy of the weight; weights never change)
        slabs = layer.__dict__.get("_weight_slabs")
        if slabs is None:
            slabs = layer.__dict__["_weight_slabs"] = column_slabs(layer.weight.detach())
        out = torch.bmm(x.expand(slabs.shape[0], -1, -1), slabs)  # [parts, rows, out / parts]
        # one row: the parts already lie in output order (a view, no copy)
        out = out.view(1, -1) if x.shape[0] == 1 else out.transpose(0, 1).reshape(x.shape[0], -1)
        return out if layer.bias is None else out + layer.bias
