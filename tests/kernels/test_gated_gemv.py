"""A gate_up linear and its silu_and_mul in one launch (gated_gemv.py), bf16 and FP8,
alone and with the norm folded in: equal to the GEMV then the SiLU kernel, bit for bit
under Triton's interpreter (each output row sums in the same order), and, marked gpu,
within rounding in a CUDA graph under PDL."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.triton import fp8_gemv  # noqa: E402
from services.kernels.triton.activation import silu_and_mul  # noqa: E402
from services.kernels.triton.fp8_gemv import Fp8GemvConfig  # noqa: E402
from services.kernels.triton.gated_gemv import (  # noqa: E402
    fp8_gemv_silu_and_mul,
    gemv_silu_and_mul,
)
from services.kernels.triton.gemv import GemvConfig, gemv  # noqa: E402
from services.kernels.triton.norm import fused_add_rms_norm  # noqa: E402
from services.kernels.triton.norm_fold import add_rms_norm_gemv  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402
from tests.kernels.test_fp8_gemm import FORMATS, TOL, make_layer  # noqa: E402
from tests.kernels.test_norm_fold import EPS, FP8_CONFIGS, FP8_FORMATS, _rows  # noqa: E402


def _same(got, ref, device, dtype):
    if device == "cpu":  # the interpreter sums each row in the same order either way
        assert torch.equal(got, ref)
    else:
        assert rel_err(got, ref) < TOL[dtype]


def _gate_up(inter, k, dtype, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * inter, k, generator=g) / k**0.5 * 2).to(dtype).to(device)


@pytest.mark.parametrize(
    "dtype,inter,config",
    [
        (torch.float32, 48, None),
        (torch.bfloat16, 48, None),
        (torch.bfloat16, 37, GemvConfig(8, 64)),  # 37 = 9 tiles of 4 and a wrapped one
        (torch.float16, 40, GemvConfig(1, 128)),  # block_n 1 runs as a pair of rows
        (torch.bfloat16, 64, GemvConfig(4, 128, k_fold=8)),
    ],
    ids=["fp32", "bf16", "bf16-ragged", "fp16-bn1", "bf16-fold8"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8], ids=["1row", "3rows", "8rows"])
def test_the_gated_gemv_equals_gemv_then_silu(dtype, inter, config, bias, rows, device):
    k = 300  # a masked last K tile
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    w = _gate_up(inter, k, dtype, device)
    b = (torch.randn(2 * inter) * 0.5).to(dtype).to(device) if bias else None
    got = gemv_silu_and_mul(x, w, b, config=config)
    assert got.shape == (rows, inter) and got.dtype == dtype
    # 2-8 rows: the tensor-core path, its tiles widened to 16 rows of W (8 gate, 8 up)
    _same(got, silu_and_mul(gemv(x, w, b, config=config)), device, dtype)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("config", **FP8_CONFIGS)
def test_the_gated_fp8_gemv_equals_fp8_gemv_then_silu(fmt, config, device):
    # 192 gate rows: the up half starts mid scale block for block_n 128 (its own scale
    # row for each tile), K not a multiple of the 128-column groups
    inter, k = 192, 328
    layer = make_layer(2 * inter, k, FORMATS[fmt], device=device, bias=True, dtype=torch.bfloat16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x = x.to(device)
    args = (layer.weight, layer.weight_scale, FORMATS[fmt], layer.bias)
    got = fp8_gemv_silu_and_mul(x, *args, config=config)
    assert got.shape == (1, inter)
    _same(got, silu_and_mul(fp8_gemv.fp8_gemv(x, *args, config=config)), device, torch.bfloat16)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_the_norm_fold_and_the_gate_in_one_launch(fp8, device):
    inter, k = 64, 256
    h, res, nw = _rows(k, torch.bfloat16, device, seed=6)
    if fp8:
        layer = make_layer(2 * inter, k, FORMATS["block"], device=device, dtype=torch.bfloat16)
        args = (layer.weight, layer.weight_scale, FORMATS["block"], None)
        out, normed, res_out = fp8_gemv.add_rms_norm_fp8_gemv(h, res, nw, EPS, *args, gated=True)
        plain = fp8_gemv.add_rms_norm_fp8_gemv(h, res, nw, EPS, *args)
    else:
        w = _gate_up(inter, k, torch.bfloat16, device)
        out, normed, res_out = add_rms_norm_gemv(h, res, nw, EPS, w, gated=True)
        plain = add_rms_norm_gemv(h, res, nw, EPS, w)
    x, res_ref = fused_add_rms_norm(h, res, nw, EPS)
    assert torch.equal(res_out, res_ref) and torch.equal(res_out, plain[2])
    _same(normed, plain[1], device, torch.bfloat16)
    _same(out, silu_and_mul(plain[0]), device, torch.bfloat16)


def test_what_the_gated_gemvs_refuse(device):
    x = torch.zeros(9, 64, dtype=torch.bfloat16, device=device)
    w = torch.zeros(16, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv_silu_and_mul(x, w)
    layer = make_layer(16, 64, FORMATS["channel"], device=device)
    with pytest.raises(ValueError, match="one row"):  # FP8: the one-row GEMV only
        fp8_gemv_silu_and_mul(x[:2], layer.weight, layer.weight_scale, FORMATS["channel"], None)
    with pytest.raises(ValueError, match="2I rows"):
        gemv_silu_and_mul(x[:1], w[:15])
    with pytest.raises(ValueError, match="split_k 1"):
        gemv_silu_and_mul(x[:1], w, config=GemvConfig(4, 16, split_k=2))
    layer = make_layer(2 * 12, 128, FORMATS["block"], device=device)
    args = (layer.weight, layer.weight_scale, FORMATS["block"], None)
    # 12 gate rows in tiles of 8 rows (4 gate, 4 up) fit; tiles of 16 (8 + 8) do not
    assert fp8_gemv_silu_and_mul(x[:1, :1].expand(1, 128).contiguous(), *args,
                                 config=Fp8GemvConfig(8, 128)).shape == (1, 12)  # fmt: skip
    with pytest.raises(ValueError, match="cannot take 24 rows"):
        fp8_gemv_silu_and_mul(x[:1].new_zeros(1, 128), *args, config=Fp8GemvConfig(16, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_the_gated_gemv_at_llama_shapes_in_a_graph_under_pdl(fp8, device):
    """Llama-3-8B's o_proj, then its gate_up with the SiLU in the GEMV, then down,
    captured in a CUDA graph (PDL on where the GPU has it), against the unfused ops."""
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    k, inter = 4096, 14336
    g = torch.Generator(device=device).manual_seed(7)
    h = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)
    w_o = (torch.randn(k, k, device=device, generator=g) / k**0.5).to(torch.bfloat16)
    if fp8:
        layer = make_layer(2 * inter, k, FORMATS["block"], device=device, dtype=torch.bfloat16)
        args = (layer.weight, layer.weight_scale, FORMATS["block"], None)

        def gated(x):
            return fp8_gemv_silu_and_mul(x, *args)

        def plain(x):
            return silu_and_mul(fp8_gemv.fp8_gemv(x, *args))
    else:
        w = _gate_up(inter, k, torch.bfloat16, device)

        def gated(x):
            return gemv_silu_and_mul(x, w)

        def plain(x):
            return silu_and_mul(gemv(x, w))

    gated(gemv(h, w_o))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated(gemv(h, w_o))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, plain(gemv(h, w_o))) < TOL[torch.bfloat16]
