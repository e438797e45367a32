"""The CPU candidates' linear: cpu_slab (rows as one batched matmul over per-thread
column slabs of the weight) and cpu_onednn (oneDNN on a weight reordered once). Each
must equal nn.Linear's result for any row count, with and without bias, when the
output does not split evenly, in fp32 and bf16, and leave the weight itself untouched.
(Which of them runs is the CPU tuner's choice: test_tuner.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.cpu_backend import CpuOneDnnBackend, CpuSlabBackend

BACKENDS = {
    "cpu_slab": (CpuSlabBackend, "_weight_slabs"),
    "cpu_onednn": (CpuOneDnnBackend, "_onednn_weight"),
}
# fp32: a different summation order; bf16: outputs rounded to 8 bits of mantissa
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("out_features,bias", [(96, False), (50, True), (7, False)])
def test_cpu_linear_matches_nn_linear(name, dtype, rows, out_features, bias):
    backend_cls, cached = BACKENDS[name]
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    layer = torch.nn.Linear(40, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, 40, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    weight_before = layer.weight.detach().clone()
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    backend = backend_cls()
    if name == "cpu_onednn" and dtype == torch.bfloat16 and not backend._bf16_supported:
        with pytest.raises(RuntimeError, match="bf16 linears need AVX-512"):
            backend.linear(x, layer)  # an AVX2-only CPU: refused with the reason
        assert "_onednn_weight" not in layer.__dict__
        return
    out = backend.linear(x, layer)
    ref = F.linear(x.float(), layer.weight.float(), None if bias is False else layer.bias.float())
    assert out.shape == ref.shape and out.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)
    assert torch.equal(layer.weight, weight_before)
    assert cached in layer.__dict__  # built once, kept with the layer
    if name == "cpu_slab":
        slabs = layer.__dict__["_weight_slabs"]
        assert slabs.shape[0] * slabs.shape[2] == out_features
        assert out_features % slabs.shape[0] == 0


def test_onednn_reuses_its_reordered_weight_and_leaves_other_inputs_to_the_reference():
    backend = CpuOneDnnBackend()
    layer = torch.nn.Linear(16, 8, bias=False)  # fp32: every CPU packs it
    x = torch.randn(4, 16)
    first = backend.linear(x, layer)
    packed = layer.__dict__["_onednn_weight"]
    assert torch.equal(backend.linear(x, layer), first)
    assert layer.__dict__["_onednn_weight"] is packed
    # a dtype oneDNN's prepacked path is not used for: the reference's F.linear
    half = torch.nn.Linear(16, 8, bias=False, dtype=torch.float16)
    xh = torch.randn(2, 16, dtype=torch.float16)
    assert torch.equal(backend.linear(xh, half), F.linear(xh, half.weight))
    assert "_onednn_weight" not in half.__dict__


def test_slabs_follow_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        layer = torch.nn.Linear(8, 12, bias=False)
        CpuSlabBackend().linear(torch.randn(1, 8), layer)
        assert layer.__dict__["_weight_slabs"].shape == (2, 8, 6)
    finally:
        torch.set_num_threads(threads)
