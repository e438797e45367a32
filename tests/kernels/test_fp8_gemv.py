"""pdserve's fused FP8 GEMV (one decode row, activation quantization inside) against
the reference FP8 math (services/kernels/fp8.py): on the CPU under Triton's
interpreter and, marked gpu, on a GPU. It accumulates in plain fp32 FMAs (no FP8
tensor-core MMA), so the fp32 bound is the same on both."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.fp8 import Fp8Format, fp8_linear_reference  # noqa: E402
from services.kernels.triton import fp8_gemm, fp8_gemv  # noqa: E402
from services.kernels.triton.fp8_gemv import Fp8GemvConfig  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402
from tests.kernels.test_fp8_gemm import FORMATS, TOL, _x, make_layer  # noqa: E402

CONFIGS = [
    Fp8GemvConfig(1, 128, 1),  # one row per program, one group per tile
    Fp8GemvConfig(4, 256, 2),  # two groups per tile, a masked last tile
    Fp8GemvConfig(16, 1024, 4),  # the whole K in one (masked) tile
    Fp8GemvConfig(8, 128, 4, num_stages=3),  # the K loop pipelined three tiles deep
    Fp8GemvConfig(4, 256, 2, k_fold=16),  # 16 adjacent columns summed before the partial
]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_the_reference(fmt, bias, device):
    # N and K are not multiples of any block: partial scale blocks, masked tiles
    layer = make_layer(200, 328, FORMATS[fmt], device=device, bias=bias)
    x = _x(1, 328, torch.float32, device)
    out = fp8_gemv.fp8_gemv(x, layer.weight, layer.weight_scale, FORMATS[fmt], layer.bias)
    assert out.shape == (1, 200) and out.dtype == torch.float32
    assert rel_err(out, fp8_linear_reference(x, layer)) < TOL[torch.float32]
    # the triton backend's FP8 forward sends one row here, at the tuner's K-loop depth
    assert torch.equal(fp8_gemm.fp8_linear(x, layer), out)
    assert torch.equal(fp8_gemm.fp8_linear(x, layer, row_stages=3), out)
    folded = fp8_gemm.fp8_linear(x, layer, row_fold=(256, 16, 2))  # the tuner's other tile
    assert rel_err(folded, fp8_linear_reference(x, layer)) < TOL[torch.float32]
    rows16 = fp8_gemm.fp8_linear(x, layer, row_fold=(256, 16, 2, 16))  # ...with 16 rows
    assert rel_err(rows16, fp8_linear_reference(x, layer)) < TOL[torch.float32]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.block_n}x{c.block_k}s{c.num_stages}f{c.k_fold}"
)
@pytest.mark.parametrize("fmt", ["block", "block64x128", "channel", "tensor"])
def test_every_tile_shape_gives_the_reference(fmt, cfg, device):
    layer = make_layer(136, 700, FORMATS[fmt], device=device, seed=3)
    x = _x(1, 700, torch.float32, device, seed=4)
    out = fp8_gemv.fp8_gemv(
        x, layer.weight, layer.weight_scale, FORMATS[fmt], layer.bias, config=cfg
    )
    assert rel_err(out, fp8_linear_reference(x, layer)) < TOL[torch.float32]


def test_a_row_of_zeros_and_bf16_rows(device):
    layer = make_layer(64, 256, FORMATS["block"], device=device, bias=True)
    zero = torch.zeros(1, 256, device=device)
    out = fp8_gemv.fp8_gemv(zero, layer.weight, layer.weight_scale, layer.fp8_format, layer.bias)
    assert torch.equal(out[0], layer.bias)  # zero amax: zeros, not NaN, plus the bias
    x = _x(1, 256, torch.bfloat16, device)
    out = fp8_gemm.fp8_linear(x, layer)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, fp8_linear_reference(x.float(), layer)) < TOL[torch.bfloat16]


def test_what_the_gemv_takes():
    w = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    assert fp8_gemv.supports(1, FORMATS["block"], w)
    assert not fp8_gemv.supports(2, FORMATS["block"], w)  # more rows: the FP8 GEMM
    assert not fp8_gemv.supports(1, Fp8Format("block", 96, 128), w)  # a block not 2^n
    assert not fp8_gemv.supports(1, FORMATS["channel"], w.t())  # not unit stride along K
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv.fp8_gemv(torch.zeros(2, 256), w, torch.ones(8), FORMATS["channel"], None)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        Fp8GemvConfig(4, 96)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        Fp8GemvConfig(4, 128, 4, num_stages=0)
    with pytest.raises(ValueError, match="k_fold"):
        Fp8GemvConfig(4, 128, 4, k_fold=256)
    with pytest.raises(ValueError, match="k_fold"):
        Fp8GemvConfig(4, 128, 4, k_fold=3)


def test_a_non_power_of_two_block_takes_the_gemm(device):
    fmt = Fp8Format("block", 96, 128)
    layer = make_layer(200, 256, fmt, device=device)
    x = _x(1, 256, torch.float32, device)
    ref = fp8_linear_reference(x, layer)
    tol = TOL[torch.float32] if torch.device(device).type == "cpu" else 1e-3  # MMA: GEMM tol
    assert rel_err(fp8_gemm.fp8_linear(x, layer), ref) < tol


@pytest.mark.parametrize(
    "n,block_n",
    [
        (6144, 16),  # Llama-3-8B qkv: 768 8-row programs past 4 a SM, 384 fit 3 a SM
        (4096, 8),  # o, down: 512 fit one wave of 8-row programs
        (28672, 8),  # gate_up: many waves either way
        (10240, 8),  # Llama-3-70B qkv: 640 16-row programs would not fit one wave either
        (1024, 2),  # narrower below two programs a SM
    ],
)
def test_the_default_tile_makes_one_wave_where_16_rows_can(n, block_n):
    fmt = FORMATS["block"]
    assert fp8_gemv.default_config(n, 4096, fmt, num_sms=132).block_n == block_n


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_default_tiles_on_gpu_at_llama_shapes(fmt, n, k):
    layer = make_layer(n, k, FORMATS[fmt], device="cuda", seed=n + k)
    x = _x(1, k, torch.bfloat16, "cuda")
    out = fp8_gemv.fp8_gemv(x, layer.weight, layer.weight_scale, FORMATS[fmt], None)
    assert rel_err(out, fp8_linear_reference(x.float(), layer)) < TOL[torch.bfloat16]
    # fp32 in: nothing but the summation order differs from the reference
    xf = x.float()
    out = fp8_gemv.fp8_gemv(xf, layer.weight, layer.weight_scale, FORMATS[fmt], None)
    assert rel_err(out, fp8_linear_reference(xf, layer)) < TOL[torch.float32]


@pytest.mark.gpu
def test_fp8_gemv_captures_in_a_cuda_graph():
    layer = make_layer(4096, 4096, FORMATS["block"], device="cuda", bias=True)
    x = _x(1, 4096, torch.bfloat16, "cuda")
    eager = fp8_gemm.fp8_linear(x, layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm.fp8_linear(x, layer)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
