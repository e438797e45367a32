"""The residual add + RMSNorm that also quantizes the row for the FP8 GEMV after it
(norm_quant.py): its quantized row and scales equal the torch reference quantizer's,
and the GEMV reading them equals the norm then the GEMV quantizing the row itself, on
the CPU under Triton's interpreter and, marked gpu, on a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.fp8 import quantize_activation  # noqa: E402
from services.kernels.triton import fp8_gemv  # noqa: E402
from services.kernels.triton.gated_gemv import fp8_gemv_silu_and_mul  # noqa: E402
from services.kernels.triton.norm import fused_add_rms_norm  # noqa: E402
from services.kernels.triton.norm_quant import (  # noqa: E402
    add_rms_norm_quant,
    add_rms_norm_quant_fp8_gemv,
)
from tests.kernels.helpers import rel_err  # noqa: E402
from tests.kernels.test_fp8_gemm import FORMATS, TOL, make_layer  # noqa: E402
from tests.kernels.test_norm_fold import EPS, FP8_CONFIGS, FP8_FORMATS, _rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k,group", [(328, 128), (256, 64), (300, 300), (96, 128)])
def test_the_row_quantized_as_the_reference_quantizes_it(dtype, k, group, device):
    h, res, nw = _rows(k, dtype, device, seed=3)
    x, res_ref = fused_add_rms_norm(h, res, nw, EPS)
    normed, res_out, xq, xs = add_rms_norm_quant(h, res, nw, EPS, group, torch.float8_e4m3fn)
    assert torch.equal(res_out, res_ref)
    q_ref, s_ref = quantize_activation(x.float(), min(group, k))
    assert xq.dtype == dtype and xs.shape == (s_ref.shape[1],)
    if device == "cpu":  # the interpreter sums the squares in the norm kernel's order
        assert torch.equal(normed, x)
        assert torch.equal(xs, s_ref[0])
        assert torch.equal(xq.float(), q_ref.float())
    else:  # rstd may differ in its last bit: compare what the row dequantizes to
        assert rel_err(normed, x) < TOL[dtype]
        deq = xq.float() * xs.repeat_interleave(min(group, k))[:k]
        assert rel_err(deq, x.float()) < 0.07  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("config", **FP8_CONFIGS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_gemv_on_the_quantized_row_equals_norm_then_fp8_gemv(fmt, config, gated, device):
    # K and N not multiples of 128: partial scale blocks, masked tiles (gated: N / 2
    # rows of gate, a multiple of every tile's gate rows)
    k, n = 328, 192 if gated else 136
    layer = make_layer(n, k, FORMATS[fmt], device=device, bias=True, dtype=torch.bfloat16)
    h, res, nw = _rows(k, torch.bfloat16, device, seed=2)
    x, res_ref = fused_add_rms_norm(h, res, nw, EPS)
    args = (layer.weight, layer.weight_scale, FORMATS[fmt], layer.bias)
    out, normed, res_out = add_rms_norm_quant_fp8_gemv(
        h, res, nw, EPS, *args, config=config, gated=gated
    )
    assert torch.equal(res_out, res_ref)
    gemv = fp8_gemv_silu_and_mul if gated else fp8_gemv.fp8_gemv
    ref = gemv(x, *args, config=config)
    assert out.shape == ref.shape == (1, n // 2 if gated else n)
    # the same quantized row (same amax, same roundings), summed in the same order
    assert torch.equal(out, ref) if device == "cpu" else rel_err(out, ref) < TOL[torch.bfloat16]
    assert torch.equal(normed, x) if device == "cpu" else rel_err(normed, x) < TOL[torch.bfloat16]


def test_what_the_quantized_norm_refuses(device):
    h, res, nw = _rows(256, torch.bfloat16, device)
    with pytest.raises(ValueError, match="power-of-two group"):
        add_rms_norm_quant(h, res, nw, EPS, 96, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one row"):
        add_rms_norm_quant(h.expand(2, 256), res.expand(2, 256), nw, EPS, 128, torch.float8_e4m3fn)
    layer = make_layer(8, 256, FORMATS["block"], device=device)
    strided = layer.weight.t().contiguous().t()  # column-major: the GEMV takes row-major only
    with pytest.raises(ValueError, match="does not take"):
        add_rms_norm_quant_fp8_gemv(
            h, res, nw, EPS, strided, layer.weight_scale, FORMATS["block"], None
        )


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["qkv", "gate_up"])
def test_at_llama_shapes_in_a_graph_under_pdl(gated, device):
    """Llama-3-8B's o_proj, then the quantizing norm and the FP8 qkv or gated gate_up
    GEMV, captured in a CUDA graph (PDL on where the GPU has it), equal the norm then the
    GEMV quantizing the row itself."""
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    from services.kernels.triton.gemv import gemv

    k, n = 4096, 28672 if gated else 6144
    h_in, res, nw = _rows(k, torch.bfloat16, device, seed=5)
    w_o = (torch.randn(k, k, device=device) / k**0.5).to(torch.bfloat16)
    layer = make_layer(n, k, FORMATS["block"], device=device, dtype=torch.bfloat16)
    args = (layer.weight, layer.weight_scale, FORMATS["block"], None)

    def step():
        return add_rms_norm_quant_fp8_gemv(gemv(h_in, w_o), res, nw, EPS, *args, gated=gated)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, normed, res_out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    x, res_ref = fused_add_rms_norm(gemv(h_in, w_o), res, nw, EPS)
    assert torch.equal(res_out, res_ref)
    assert rel_err(normed, x) < TOL[torch.bfloat16]
    ref = (fp8_gemv_silu_and_mul if gated else fp8_gemv.fp8_gemv)(x, *args)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
