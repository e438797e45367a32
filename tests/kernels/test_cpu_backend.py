"""The cpu_slab candidate's linear: rows run as one batched matmul over per-thread
column slabs of the weight; the result must equal nn.Linear's for any row count, with
and without bias, when the output does not split evenly, and the weight itself must
stay untouched. (Which of it and the plain GEMM runs is the CPU tuner's choice:
test_tuner.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.cpu_backend import CpuSlabBackend


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("out_features,bias", [(96, False), (50, True), (7, False)])
def test_cpu_linear_matches_nn_linear(rows, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    layer = torch.nn.Linear(40, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, 40, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    weight_before = layer.weight.detach().clone()
    x = torch.randn(rows, 40, generator=gen)
    out = CpuSlabBackend().linear(x, layer)
    ref = F.linear(x, layer.weight, layer.bias)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, weight_before)
    slabs = layer.__dict__["_weight_slabs"]
    assert slabs.shape[0] * slabs.shape[2] == out_features
    assert out_features % slabs.shape[0] == 0


def test_slabs_follow_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        layer = torch.nn.Linear(8, 12, bias=False)
        CpuSlabBackend().linear(torch.randn(1, 8), layer)
        assert layer.__dict__["_weight_slabs"].shape == (2, 8, 6)
    finally:
        torch.set_num_threads(threads)
