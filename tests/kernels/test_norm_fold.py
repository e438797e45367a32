"""The residual add + RMSNorm folded into the next one-row GEMV (bf16 and FP8): the
output, the normalised row and the new residual equal what fused_add_rms_norm and
then the GEMV compute, on the CPU under Triton's interpreter and, marked gpu, on a
GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.triton import fp8_gemv  # noqa: E402
from services.kernels.triton.fp8_gemv import Fp8GemvConfig  # noqa: E402
from services.kernels.triton.gemv import GemvConfig, gemv  # noqa: E402
from services.kernels.triton.norm import fused_add_rms_norm  # noqa: E402
from services.kernels.triton.norm_fold import add_rms_norm_gemv  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402
from tests.kernels.test_fp8_gemm import FORMATS, TOL, make_layer  # noqa: E402

EPS = 1e-5


def _rows(k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, k, generator=g) * 3
    res = torch.randn(1, k, generator=g)
    res[:, ::7] *= 20  # outliers: groups with different ranges after the norm
    nw = 1 + 0.3 * torch.randn(k, generator=g)
    return (t.to(dtype).to(device) for t in (h, res, nw))


@pytest.mark.parametrize(
    "dtype,config",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float16, GemvConfig(4, 128)),  # K=300: a masked last tile
        (torch.bfloat16, GemvConfig(8, 64, split_k=3)),  # each split finds the whole row's rms
        (torch.bfloat16, GemvConfig(2, 128, k_fold=8)),
    ],
    ids=["fp32", "bf16", "fp16-masked", "bf16-split3", "bf16-fold8"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_fold_equals_norm_then_gemv(dtype, config, bias, device):
    k, n = 300, 72
    h, res, nw = _rows(k, dtype, device)
    w = (torch.randn(n, k) / k**0.5).to(dtype).to(device)
    b = torch.randn(n).to(dtype).to(device) if bias else None
    x, res_ref = fused_add_rms_norm(h, res, nw, EPS)
    out, normed, res_out = add_rms_norm_gemv(h, res, nw, EPS, w, b, config=config)
    assert torch.equal(res_out, res_ref)  # the next layer's residual, bit for bit
    ref = gemv(x, w, b, config=config)
    if device == "cpu":  # the interpreter sums both in one order
        assert torch.equal(normed, x)  # what a MoE's experts read after the router
        assert torch.equal(out, ref)
    else:  # a GPU sums the squares in another order: rstd may differ in its last bit
        assert rel_err(normed, x) < TOL[dtype] and rel_err(out, ref) < TOL[dtype]


FP8_FORMATS = ["block", "block64x128", "channel", "tensor"]
FP8_CONFIGS = dict(
    argvalues=[None, Fp8GemvConfig(4, 256, 2), Fp8GemvConfig(8, 128, 4, num_stages=3)],
    ids=["default", "4x256", "8x128s3"],
)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("config", **FP8_CONFIGS)
def test_the_fp8_fold_equals_norm_then_fp8_gemv(fmt, config, device):
    k, n = 328, 136  # not multiples of any block: partial scale blocks, masked tiles
    layer = make_layer(n, k, FORMATS[fmt], device=device, bias=True, dtype=torch.bfloat16)
    h, res, nw = _rows(k, torch.bfloat16, device, seed=2)
    x, res_ref = fused_add_rms_norm(h, res, nw, EPS)
    args = (layer.weight, layer.weight_scale, FORMATS[fmt], layer.bias)
    out, normed, res_out = fp8_gemv.add_rms_norm_fp8_gemv(h, res, nw, EPS, *args, config=config)
    assert torch.equal(res_out, res_ref)
    assert torch.equal(normed, x) if device == "cpu" else rel_err(normed, x) < TOL[torch.bfloat16]
    ref = fp8_gemv.fp8_gemv(x, *args, config=config)
    # the same quantized row (same amax, same roundings), summed in the same order
    assert torch.equal(out, ref) if device == "cpu" else rel_err(out, ref) < TOL[torch.bfloat16]


def test_what_the_folds_refuse(device):
    h, res, nw = _rows(64, torch.bfloat16, device)
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="one row"):
        add_rms_norm_gemv(h.expand(2, 64), res.expand(2, 64), nw, EPS, w)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm_gemv(h, res.float(), nw, EPS, w)
    layer = make_layer(8, 128, FORMATS["block"], device=device)
    h, res, nw = _rows(128, torch.bfloat16, device)
    args = (layer.weight, layer.weight_scale, FORMATS["block"], None)
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_gemv.add_rms_norm_fp8_gemv(h, res, nw[:64], EPS, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_the_fold_at_llama_shapes_in_a_graph_under_pdl(fp8, device):
    """Llama-3-8B's o_proj then the norm folded into qkv, captured in a CUDA graph (PDL
    on where the GPU has it): the fold waits for the GEMV before it and equals the
    norm then the GEMV."""
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    k, n = 4096, 6144
    h_in, res, nw = _rows(k, torch.bfloat16, device, seed=5)
    w_o = (torch.randn(k, k, device=device) / k**0.5).to(torch.bfloat16)
    if fp8:
        layer = make_layer(n, k, FORMATS["block"], device=device, dtype=torch.bfloat16)
        args = (layer.weight, layer.weight_scale, FORMATS["block"], None)

        def fold(h):
            return fp8_gemv.add_rms_norm_fp8_gemv(h, res, nw, EPS, *args)

        def plain(x):
            return fp8_gemv.fp8_gemv(x, *args)
    else:
        w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)

        def fold(h):
            return add_rms_norm_gemv(h, res, nw, EPS, w)

        def plain(x):
            return gemv(x, w)

    fold(gemv(h_in, w_o))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, normed, res_out = fold(gemv(h_in, w_o))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    x, res_ref = fused_add_rms_norm(gemv(h_in, w_o), res, nw, EPS)
    assert torch.equal(res_out, res_ref)
    assert rel_err(normed, x) < TOL[torch.bfloat16]
    assert rel_err(out, plain(x)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_the_fold_is_chosen_where_it_was_timed_faster(device):
    """On an H100/H200 the backend folds Qwen3-30B-A3B's norms (qkv, router), not
    Llama-3-8B's (qkv, gate_up; bf16 or FP8), as norm_fold.py measured."""
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    from services.kernels.triton import fp8_gemv
    from services.kernels.triton.gemv import launch_config
    from services.kernels.triton.norm_fold import fold_pays

    row = torch.zeros(1, 2048, dtype=torch.bfloat16, device=device)
    for n in (5120, 128):  # Qwen3-30B-A3B's qkv and router
        assert fold_pays(row, n, launch_config(row, n).block_n)
    row = torch.zeros(1, 4096, dtype=torch.bfloat16, device=device)
    fmt = FORMATS["block"]
    for n in (6144, 28672):  # Llama-3-8B's qkv and gate_up
        assert not fold_pays(row, n, launch_config(row, n).block_n)
        block_n = fp8_gemv.launch_config(row, n, fmt).block_n
        assert not fold_pays(row, n, block_n, fp8=True)
