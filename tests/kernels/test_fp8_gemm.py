"""FP8 linear kernels against the reference (services/kernels/fp8.py: activations
quantized the same way, weights dequantized, fp32 matmul): pdserve's Triton FP8 GEMM
and activation quantizer on the CPU under Triton's interpreter (which handles
float8_e4m3fn loads, stores and dots) and on a GPU; on a GPU (marked gpu) every FP8
candidate (torch reference, triton, torch._scaled_mm, AITER's a8w8 GEMMs) at
Llama-3-8B projection shapes."""

from __future__ import annotations

import functools
import warnings

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Fp8Format,
    dequantize_activation,
    dequantize_weight,
    fp8_linear_reference,
    quantize_activation,
)
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton import fp8_gemm as tk  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402

FORMATS = {
    "block": Fp8Format("block", 128, 128),
    "block64x128": Fp8Format("block", 64, 128),  # block_n below the GEMM's BLOCK_N
    "channel": Fp8Format("channel"),
    "tensor": Fp8Format("tensor"),
}
# Against the reference the only differences are the fp32 summation order, the output
# rounding and, for 16-bit inputs, an activation rounded to FP8 from a slightly
# different value at a rounding boundary
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# fp32 outputs of FP8 tensor-core GEMMs on a GPU: Hopper's FP8 MMA keeps ~14 bits of
# its fp32 accumulator between K steps (DeepSeek-V3 report, sec. 3.3.2), so a GEMM
# over a few hundred K measured 2e-4 against the exact reference on an H200 (CPU: the
# interpreter accumulates in full fp32).
FP32_GPU_TOL = 1e-3


def fp32_tol(device) -> float:
    return FP32_GPU_TOL if torch.device(device).type == "cuda" else TOL[torch.float32]


class _Layer(torch.nn.Module):
    """An FP8 linear as the kernels see it (the model's Fp8Linear has the same fields)."""

    def __init__(self, weight, scale, fmt, bias=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.fp8_format = fmt


def make_layer(n, k, fmt, *, device, seed=0, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.rand(n, k, generator=g) * 2 - 1).mul(400).to(FP8_DTYPE)
    shape = fmt.scale_shape(n, k)
    scale = (torch.rand(shape, generator=g) + 0.5) * (k**-0.5) / 200
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    layer = _Layer(weight.to(device), scale.to(device), fmt, None if b is None else b.to(device))
    return layer


def _x(m, k, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, ::7] *= 20  # outliers: groups and rows with different ranges
    return x.to(dtype).to(device)


def test_quantize_activation_equals_the_reference(device):
    x = _x(5, 300, torch.float32, device)
    for group in (128, 300):
        q, s = tk.quantize_activation(x, group)
        rq, rs = quantize_activation(x, group)
        assert q.dtype == FP8_DTYPE and s.shape == (5, -(-300 // group))
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
        # the same FP8 values (a GPU's fast fp32 division may flip a rare rounding tie)
        same = (q.float() == rq.float()).float().mean().item()
        assert same == 1.0 if device == "cpu" else same > 0.999
        deq = dequantize_activation(q, s, group)
        assert rel_err(deq, x) < 0.05  # FP8 keeps ~3 significant bits


def test_quantize_activation_pads_rows_and_lays_scales_column_major(device):
    # the operands cuBLASLt's block scaling wants: rows padded to 16, scales [R, G]
    # stored as [G, R] transposed; the real rows equal the plain call's
    x = _x(5, 300, torch.float32, device)
    q, s = tk.quantize_activation(x, 128)
    pq, ps = tk.quantize_activation(x, 128, rows=16, column_major_scales=True)
    assert pq.shape == (16, 300) and ps.shape == (16, 3) and ps.stride() == (1, 16)
    assert torch.equal(pq[:5].float(), q.float()) and torch.equal(ps[:5], s)
    assert not pq[5:].float().any() and torch.equal(ps[5:], torch.ones_like(ps[5:]))
    with pytest.raises(ValueError, match="rows"):
        tk.quantize_activation(x, 128, rows=4)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 37])
def test_triton_fp8_gemm_matches_the_reference(fmt, m, device):
    # N and K are not multiples of any block: partial scale blocks and masked tiles
    layer = make_layer(200, 328, FORMATS[fmt], device=device, bias=m == 37)
    x = _x(m, 328, torch.float32, device)
    out = tk.fp8_linear(x, layer)
    ref = fp8_linear_reference(x, layer)
    assert out.shape == (m, 200) and out.dtype == torch.float32
    assert rel_err(out, ref) < fp32_tol(device)


def test_the_reference_is_dequantized_math(device):
    """What the reference computes, spelled out once with plain ops."""
    fmt = FORMATS["block"]
    layer = make_layer(130, 260, fmt, device=device, bias=True)
    x = _x(3, 260, torch.float32, device)
    xq, xs = quantize_activation(x, 128)
    xd = xq.float() * xs.repeat_interleave(128, 1)[:, :260]
    w = (
        layer.weight.float()
        * layer.weight_scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :260]
    )
    expected = xd @ w.t() + layer.bias
    torch.testing.assert_close(fp8_linear_reference(x, layer), expected, rtol=1e-5, atol=1e-5)
    # and an FP8 layer's output tracks the unquantized math within FP8's precision
    plain = x @ dequantize_weight(layer.weight, layer.weight_scale, fmt).t() + layer.bias
    assert rel_err(fp8_linear_reference(x, layer), plain) < 0.05


def test_backends_dispatch_fp8_layers(device):
    layer = make_layer(64, 128, FORMATS["channel"], device=device)
    x = _x(4, 128, torch.float32, device)
    ref = fp8_linear_reference(x, layer)
    assert torch.equal(TorchBackend().linear(x, layer), ref)
    assert rel_err(TritonBackend().linear(x, layer), ref) < fp32_tol(device)
    # 3-D input, as a model may pass
    out3 = TritonBackend().linear(x.view(2, 2, 128), layer)
    assert out3.shape == (2, 2, 64)


# ---- AITER's a8w8 GEMMs (through the shims) ----------------------------------------------
@pytest.fixture
def aiter_backend(monkeypatch, device):
    from services.kernels import aiter_shims, get_backend

    if aiter_shims.installed_version() is None:
        pytest.skip("amd-aiter is not installed (pip install amd-aiter)")
    if device == "cpu":
        # The interpreter asserts tl.assume hints, which compiled code only trusts:
        # AITER's block-scale GEMM states `stride_ck > 0` while passing 0 when K is not
        # split, and its split-K reduction states `pid_m > 0` on program 0. Checking
        # them here would test the hints, not the math.
        from triton.runtime import interpreter

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_assume", lambda self, c: None)
    try:
        return get_backend("aiter")
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_aiter_fp8_gemms_match_the_reference(fmt, aiter_backend, device):
    for m in (1, 37):
        layer = make_layer(200, 328, FORMATS[fmt], device=device, bias=fmt == "channel")
        x = _x(m, 328, torch.float32, device)
        out = aiter_backend.linear(x, layer)
        assert rel_err(out, fp8_linear_reference(x, layer)) < fp32_tol(device)


# ---- every FP8 candidate on a GPU ------------------------------------------------------
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@functools.cache
def _gpu_candidates():
    from services.kernels.scaled_mm_backend import ScaledMMBackend

    out = {"torch": TorchBackend(), "triton": TritonBackend(), "scaled_mm": ScaledMMBackend()}
    try:
        from services.kernels.aiter_backend import AiterBackend

        out["aiter"] = AiterBackend(use_triton_gemm=True)
    except ImportError as exc:  # amd-aiter not brought to this GPU: said, not hidden
        warnings.warn(f"aiter FP8 GEMMs not tested: {exc}", stacklevel=1)
    return out


def _supports(name, fmt) -> bool:
    # cuBLASLt through torch._scaled_mm: per-tensor, row-wise and 128 x 128 block scales
    odd_block = fmt.granularity == "block" and (fmt.block_n, fmt.block_k) != (128, 128)
    return not (name == "scaled_mm" and odd_block)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_every_fp8_candidate_matches_the_reference_on_gpu(n, k, fmt, m):
    dtype = torch.bfloat16
    layer = make_layer(n, k, FORMATS[fmt], device="cuda", seed=n + k)
    x = _x(m, k, dtype, "cuda")
    ref = fp8_linear_reference(x.float(), layer)
    for name, backend in _gpu_candidates().items():
        if not _supports(name, FORMATS[fmt]):
            with pytest.raises(ValueError, match="block"):
                backend.linear(x, layer)
            continue
        out = backend.linear(x, layer)
        assert out.dtype == dtype and out.shape == (m, n), name
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.gpu
def test_scaled_mm_refuses_blocks_cublaslt_cannot_scale():
    backend = _gpu_candidates()["scaled_mm"]
    layer = make_layer(256, 256, FORMATS["block64x128"], device="cuda")
    with pytest.raises(ValueError, match="128 x 128 weight blocks, not 64 x 128"):
        backend.linear(_x(4, 256, torch.bfloat16, "cuda"), layer)
    block = make_layer(256, 256, FORMATS["block"], device="cuda")
    with pytest.raises(ValueError, match="bfloat16 only"):
        backend.linear(_x(4, 256, torch.float16, "cuda"), block)


@pytest.mark.gpu
def test_fp8_linears_capture_in_cuda_graphs():
    layer = make_layer(4096, 4096, FORMATS["block"], device="cuda")
    channel = make_layer(4096, 4096, FORMATS["channel"], device="cuda")
    x = _x(8, 4096, torch.bfloat16, "cuda")
    for name, backend in _gpu_candidates().items():
        for lay in (layer, channel):
            if not _supports(name, lay.fp8_format) or name == "torch":
                continue
            eager = backend.linear(x, lay)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                backend.linear(x, lay)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = backend.linear(x, lay)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), name


# ---- the engine on FP8 weights ---------------------------------------------------------
def test_engine_on_fp8_weights_triton_equals_torch(tmp_path, device, monkeypatch):
    """Online-quantized tiny Llama (GQA 8/2, head_dim 16): the triton backend's FP8 GEMM
    inside the engine (interpreted on a CPU) gives the torch reference's tokens."""
    from services.engine import LLM, SamplingParams
    from tests.engine.helpers import save_random_model

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = save_random_model(tmp_path / "llama", "llama")
    prompts = [[5, 9, 200, 31], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = {}
    # tuned: every choice given (no measuring under the interpreter); FP8 layers must
    # reach fp8_linear's pick, which the engine's KernelShapes has to ask for
    tuned = (
        "linear=torch,rms_norm=torch,fused_add_rms_norm=torch,rotary_embedding=torch,"
        "silu_and_mul=torch,store_kv_cache=triton,paged_attention=triton,fp8_linear=triton"
    )
    for backend in ("torch", "triton", "tuned"):
        llm = LLM(
            str(model_dir),
            kernel_backend=backend,
            kernel_choices=tuned if backend == "tuned" else None,
            device=device,
            dtype="float32",
            quantization="fp8",
            max_num_batched_tokens=24,
            num_kv_blocks=16,
        )
        outs[backend] = llm.generate(prompts, params)
    assert [o.output.token_ids for o in outs["tuned"]] == [
        o.output.token_ids for o in outs["triton"]
    ]
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.output.token_ids == b.output.token_ids
        for x, y, t in zip(a.output.logprobs, b.output.logprobs, a.output.token_ids):
            assert abs(x[t].logprob - y[t].logprob) < 1e-3


def test_the_engine_asks_the_tuner_for_its_fp8_format():
    """The tuned backend measures fp8_linear on the format the loader will build."""
    from transformers import LlamaConfig

    from services.engine import EngineConfig
    from services.engine.kernel_shapes import kernel_shapes

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96)
    plain = EngineConfig(model="unused", dtype="float32")
    assert kernel_shapes(plain, hf).weight_quant == ""
    online = EngineConfig(model="unused", dtype="float32", quantization="fp8")
    assert kernel_shapes(online, hf).weight_quant == "fp8_channel"
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert kernel_shapes(plain, hf).weight_quant == "fp8_block_128x128"


def test_the_engine_asks_the_tuner_for_fp8_experts_where_the_loader_keeps_them():
    from transformers import Qwen3MoeConfig

    from services.engine import EngineConfig
    from services.engine.kernel_shapes import kernel_shapes

    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    plain = EngineConfig(model="unused", dtype="float32")
    hf = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, moe_intermediate_size=128)
    assert not kernel_shapes(plain, hf).fp8_experts  # unquantized
    hf.quantization_config = block
    shapes = kernel_shapes(plain, hf)
    assert shapes.fp8_experts and shapes.weight_quant == "fp8_block_128x128"
    odd = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, moe_intermediate_size=96)
    odd.quantization_config = block  # 96 is no multiple of 128: dequantized at load
    assert not kernel_shapes(plain, odd).fp8_experts
    online = EngineConfig(model="unused", dtype="float32", quantization="fp8")
    hf.quantization_config = None  # online: the experts quantized per channel as they load
    online_shapes = kernel_shapes(online, hf)
    assert online_shapes.fp8_experts and online_shapes.expert_fp8_format().granularity == "channel"
