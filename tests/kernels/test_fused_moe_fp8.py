"""FP8 experts in the fused MoE (block-FP8 w13 / w2 with their scales, fp8.Fp8Experts):
pdserve's Triton fused MoE against the torch reference (per expert: both GEMMs' inputs
quantized per token and block_k group, dequantized weights, fp32), on the CPU under
Triton's interpreter and, marked gpu, on a GPU at Qwen3-30B-A3B's expert shapes; the
reference against a plain dequantized computation; and the refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Fp8Experts,
    Fp8Format,
    dequantize_weight,
    experts_fit_fp8,
)
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton.moe import fused_moe  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402

REF = TorchBackend()
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)


def _experts(e, h, inter, fmt, device, seed=0):
    """Random FP8 experts with scales that differ block to block (row to row)."""
    g = torch.Generator().manual_seed(seed)

    def weight(rows, cols, fan_in):
        w = ((torch.rand(e, rows, cols, generator=g) * 2 - 1) * 400).to(FP8_DTYPE)
        if fmt.granularity == "block":
            s = torch.rand(e, rows // fmt.block_n, cols // fmt.block_k, generator=g) + 0.5
        else:
            s = torch.rand(e, rows, generator=g) + 0.5
        return w.to(device), (s * fan_in**-0.5 / 400).to(device)

    w13, s13 = weight(2 * inter, h, h)
    w2, s2 = weight(h, inter, inter)
    return w13, w2, Fp8Experts(s13, s2, fmt)


def _inputs(t, e, h, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    x[:, ::5] *= 8  # groups with different ranges
    # every expert but the last is chosen; expert 0 by every token (repeats in a batch)
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] += 10
    logits[:, -1] -= 10
    return x.to(dtype).to(device), logits.to(device)


def _dequantized(x, logits, w13, w2, fp8, top_k):
    """The same experts dequantized, activations unquantized: what W8A8 approximates."""
    deq13 = torch.stack([dequantize_weight(w, s, fp8.fmt) for w, s in zip(w13, fp8.w13_scale)])
    deq2 = torch.stack([dequantize_weight(w, s, fp8.fmt) for w, s in zip(w2, fp8.w2_scale)])
    return REF.fused_moe(x.float(), logits, deq13, deq2, top_k, True)


@pytest.mark.parametrize(
    "fmt,h,inter,config",
    [
        (Fp8Format("block", 16, 16), 32, 16, SMALL),
        (Fp8Format("block", 128, 128), 256, 128, None),  # the published block size
        (Fp8Format("channel"), 32, 24, SMALL),  # llm-compressor's FP8_DYNAMIC experts
        (Fp8Format("channel"), 256, 128, None),
    ],
    ids=["block16", "block128", "channel-small", "channel"],
)
@pytest.mark.parametrize("t", [1, 5])
def test_triton_fp8_moe_matches_the_reference(fmt, h, inter, config, t, device):
    e, top_k = 4, 2
    w13, w2, fp8 = _experts(e, h, inter, fmt, device)
    x, logits = _inputs(t, e, h, torch.float32, device)
    ref = REF.fused_moe(x, logits, w13, w2, top_k, True, fp8=fp8)
    out = fused_moe(x, logits, w13, w2, top_k, True, config=config, fp8=fp8)
    assert out.shape == (t, h) and out.dtype == x.dtype
    # the same quantizations on both sides; fp32 summation order differs, which may
    # move an intermediate activation across an e4m3 rounding boundary now and then
    assert rel_err(out, ref) < 1e-4
    # and the reference is W8A8 of the dequantized experts: a few per cent off them
    assert 1e-4 < rel_err(ref, _dequantized(x, logits, w13, w2, fp8, top_k)) < 0.1


def test_backends_pass_fp8_experts_through(device):
    fmt = Fp8Format("block", 16, 16)
    w13, w2, fp8 = _experts(4, 32, 16, fmt, device, seed=3)
    x, logits = _inputs(3, 4, 32, torch.float32, device, seed=4)
    ref = REF.fused_moe(x, logits, w13, w2, 2, False, fp8=fp8)
    out = TritonBackend().fused_moe(x, logits, w13, w2, 2, False, config=SMALL, fp8=fp8)
    assert rel_err(out, ref) < 1e-4


def test_fp8_experts_are_refused_where_they_cannot_run(device):
    fmt = Fp8Format("block", 16, 16)
    w13, w2, fp8 = _experts(4, 32, 16, fmt, device)
    x, logits = _inputs(2, 4, 32, torch.float32, device)
    gemv = {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 4}
    with pytest.raises(ValueError, match="GEMV path .* no FP8"):
        fused_moe(x, logits, w13, w2, 2, True, config=gemv, fp8=fp8)
    bad = Fp8Experts(fp8.w13_scale[:, :1], fp8.w2_scale, fmt)
    with pytest.raises(ValueError, match="scales must be"):
        fused_moe(x, logits, w13, w2, 2, True, config=SMALL, fp8=bad)
    with pytest.raises(ValueError, match="FP8 w13 and w2"):
        fused_moe(x, logits, w13.float(), w2.float(), 2, True, config=SMALL, fp8=fp8)
    # experts whose blocks do not tile I stay out of FP8 (the loader dequantizes them)
    assert not experts_fit_fp8(Fp8Format("block", 128, 128), 2048, 96)
    assert experts_fit_fp8(Fp8Format("block", 128, 128), 2048, 768)
    assert experts_fit_fp8(Fp8Format("channel"), 2048, 96)
    assert not experts_fit_fp8(Fp8Format("tensor"), 2048, 768)  # the loader makes channel


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Fp8Format("block", 128, 128), Fp8Format("channel")], ids=str)
@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_fp8_moe_on_gpu_at_qwen3_30b_a3b_shapes(t, fmt):
    # 128 experts, top-8, H 2048, I 768, bf16 activations; CUDA-graph replay equals eager
    e, h, inter, top_k = 128, 2048, 768, 8
    w13, w2, fp8 = _experts(e, h, inter, fmt, "cuda")
    x, logits = _inputs(t, e, h, torch.bfloat16, "cuda")
    ref = REF.fused_moe(x.float(), logits, w13, w2, top_k, True, fp8=fp8)
    out = fused_moe(x, logits, w13, w2, top_k, True, fp8=fp8)
    assert rel_err(out, ref) < 2e-2  # bf16 activations and intermediate
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, logits, w13, w2, top_k, True, fp8=fp8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, logits, w13, w2, top_k, True, fp8=fp8)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


def test_engine_on_fp8_experts_triton_equals_torch(tmp_path, device, monkeypatch):
    """The block-FP8 Qwen3-MoE of tests/engine/test_fp8_moe.py through the engine on the
    triton backend (its FP8 fused MoE and GEMMs, interpreted on a CPU) gives the torch
    reference's tokens and logprobs; blocks return."""
    from services.engine import LLM, SamplingParams
    from tests.engine.helpers import assert_all_blocks_free
    from tests.engine.test_fp8_moe import write_fp8_moe_checkpoint

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    qdir, _, _ = write_fp8_moe_checkpoint(tmp_path)
    prompts = [[5, 9, 200, 31], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(qdir), kernel_backend=backend, device=device, max_num_batched_tokens=64)
        outs[backend] = llm.generate(prompts, params)
        assert_all_blocks_free(llm)
    for ref, out in zip(outs["torch"], outs["triton"]):
        assert out.output.token_ids == ref.output.token_ids
        for a, b, token in zip(out.output.logprobs, ref.output.logprobs, ref.output.token_ids):
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


@pytest.mark.parametrize("quant", ["fp8_block_16x16", "fp8_channel", "fp8_tensor"])
def test_tuner_measures_fused_moe_on_fp8_experts(quant, device):
    """KernelShapes.fp8_experts: the tuner's fused_moe case runs FP8 experts with block
    scales; the triton candidate matches the fp32 reference on them, one that ignored
    the scales would be rejected, and the GEMV path is not offered."""
    from services.kernels.shape_classes import KernelShapes
    from services.kernels.triton.moe_config import candidate_configs
    from services.kernels.tuner import REL_TOL, TuningSizes
    from services.kernels.tuner_cases import rel_err, run_case

    common = dict(num_experts=4, top_k=2, moe_intermediate_size=32)
    shapes = KernelShapes(
        32, 4, 2, 16, 96, 16, "bfloat16", **common, weight_quant=quant, fp8_experts=True,
    )  # fmt: skip
    # a per-tensor checkpoint's experts keep a scale per row, as the loader builds them
    want = "block" if "block" in quant else "channel"
    assert shapes.expert_fp8_format().granularity == want
    sizes = TuningSizes.tiny()
    device = torch.device(device)
    ref = run_case("fused_moe", "decode8", shapes, sizes, device, torch.float32, REF)[1]
    out = run_case("fused_moe", "decode8", shapes, sizes, device, torch.bfloat16, TritonBackend())
    assert rel_err(out[1], ref) <= REL_TOL[torch.bfloat16]

    class ScaleBlind(TritonBackend):  # a deliberately wrong candidate: unit scales
        def fused_moe(self, x, logits, w13, w2, top_k, renormalize, config=None, fp8=None):
            ones = Fp8Experts(
                torch.ones_like(fp8.w13_scale), torch.ones_like(fp8.w2_scale), fp8.fmt
            )
            return super().fused_moe(x, logits, w13, w2, top_k, renormalize, config, ones)

    blind = run_case("fused_moe", "decode8", shapes, sizes, device, torch.float32, ScaleBlind())
    assert rel_err(blind[1], ref) > 10 * REL_TOL[torch.bfloat16]
    configs = candidate_configs(1, 4, 32, 32, 2, FP8_DTYPE)
    assert configs and all(c.get("kernel", "gemm") == "gemm" for c in configs)
    with pytest.raises(ValueError, match="fp8_experts needs"):
        KernelShapes(32, 4, 2, 16, 96, 16, "bfloat16", **common, fp8_experts=True)
