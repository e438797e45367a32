"""The CPU candidates for the kernel tuner besides the torch reference. Each differs
from it in linear layers only; every other op is the reference's.

`cpu_slab`: one batched matmul over column slabs of the weight, one slab per
intra-op thread.

Why a candidate and not the default: a few rows times a weight is a matrix-vector
product, and on a 2-core AMD EPYC oneDNN/MKL ran it on one thread at ~13 GB/s, so the
slabs (every thread streams its share) took SmolLM2's layers at batch 1 from 36 to
21 ms and the LM head from 10 to 4 ms. On a 2-core Intel Xeon with AVX-512 and AMX the
plain GEMM was as fast and 16 equal requests ran slower with slabs than transformers'
own batch (issue 21). Which one wins depends on the CPU, so the tuner measures every
candidate per shape class on the machine that runs them.

`cpu_onednn`: oneDNN's linear on a weight reordered once into its blocked layout (the
prepacking torch.compile's CPU freezing does). F.linear reorders the weight on every
call; in bf16 on a Xeon with AMX the prepacked product took half the time at 1-64 rows
at SmolLM2's shapes, with the same bits."""

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


def _derived_weight(layer, key: str, build):
    """build(weight), made once per layer and kept with it under `key` (a second copy
    of the weight, in the layout a candidate wants; weights never change)."""
    derived = layer.__dict__.get(key)
    if derived is None:
        derived = layer.__dict__[key] = build(layer.weight.detach())
    return derived


class CpuSlabBackend(TorchBackend):
    name = "cpu_slab"
    weight_copy = "_weight_slabs"  # the layer attribute its copy lives in

    def linear(self, x, layer):
        if fp8_format_of(layer) is not None or x.dim() != 2 or x.device.type != "cpu":
            return super().linear(x, layer)
        slabs = _derived_weight(layer, self.weight_copy, column_slabs)
        out = torch.bmm(x.expand(slabs.shape[0], -1, -1), slabs)  # [parts, rows, out / parts]
        # one row: the parts already lie in output order (a view, no copy)
        out = out.view(1, -1) if x.shape[0] == 1 else out.transpose(0, 1).reshape(x.shape[0], -1)
        return out if layer.bias is None else out + layer.bias


class CpuOneDnnBackend(TorchBackend):
    name = "cpu_onednn"
    weight_copy = "_onednn_weight"

    def __init__(self):
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError("this torch build has no oneDNN (mkldnn)")
        # oneDNN packs a bf16 weight only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        self._bf16_supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def linear(self, x, layer):
        if (
            fp8_format_of(layer) is not None
            or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16)
        ):
            return super().linear(x, layer)
        if x.dtype == torch.bfloat16 and not self._bf16_supported:
            # refused, not sent to the reference: the tuner drops a candidate that raises
            raise RuntimeError(
                "cpu_onednn: bf16 linears need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, "
                "which this CPU lacks"
            )
        packed = _derived_weight(
            layer, self.weight_copy, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)
        )
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
