"""Block-FP8 MoE checkpoints (Qwen3-30B-A3B-FP8's format: quant_method "fp8",
weight_block_size [128, 128], every expert's gate / up / down stored in float8_e4m3fn
with a float32 `weight_scale_inv`, the router in full precision) keep their experts in
FP8: the stacked w13 / w2 hold the checkpoint's bytes, their block scales beside them,
and the fused MoE runs W8A8 like the block linears. Compared with transformers on the
dequantized twin (fp8_helpers.compare), with the expert inputs quantized there too for
the exact check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.fp8_helpers import (
    BLOCK,
    FP8,
    compare,
    fake_quant_experts,
    is_proj,
    quantize_block,
)
from tests.engine.helpers import (
    assert_all_blocks_free,
    hf_greedy,
    hf_load,
    hf_logprobs,
    save_random_moe_model,
)

EXPERT = "model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def moe_fp8(tmp_path_factory):
    return write_fp8_moe_checkpoint(tmp_path_factory.mktemp("moe_fp8"))


def write_fp8_moe_checkpoint(root, **overrides):
    """A random Qwen3-MoE in block FP8 at root/"q", its dequantized twin at root/"ref";
    returns (q, ref, the quantized tensors). overrides: config fields."""
    from safetensors.torch import load_file, save_file

    # hidden 128, experts 128 wide, 4 KV heads of 32 (q, k, v start on 128-row
    # boundaries of the fused qkv): whole 128 x 128 blocks, as the published sizes tile
    sizes = dict(
        moe_intermediate_size=128,
        num_key_value_heads=4,
        num_hidden_layers=2,  # a MoE layer and a dense one, as the dense FP8 tests
        initializer_range=0.02,
    )
    src = save_random_moe_model(root / "src", "qwen3_moe", **{**sizes, **overrides})
    tensors, deq = {}, {}
    gen = torch.Generator().manual_seed(1)
    for name, value in load_file(src / "model.safetensors").items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # unit scale: clear margins between the top logits (fp8_helpers' module doc)
            value = torch.randn(value.shape, generator=gen)
        if is_proj(name):  # attention, the dense layer's MLP and every expert
            q, scale, d = quantize_block(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
            deq[name] = d
        else:  # embeddings, norms, routers, LM head stay in full precision
            tensors[name] = deq[name] = value
    qdir = shutil.copytree(src, root / "q")
    raw = json.loads((qdir / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (qdir / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tensors.items()}, qdir / "model.safetensors")
    ref = shutil.copytree(src, root / "ref")
    save_file({k: v.contiguous() for k, v in deq.items()}, ref / "model.safetensors")
    return qdir, ref, tensors


def test_block_fp8_moe_keeps_experts_fp8_and_tracks_transformers(moe_fp8, caplog):
    # the torch reference's fused MoE here; the Triton one inside the engine:
    # tests/kernels/test_fused_moe_fp8.py (interpreted)
    qdir, ref, tensors = moe_fp8
    with caplog.at_level("INFO"):
        llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=64)
    assert "keep their experts in FP8" in caplog.text
    assert "dequantized at load" not in caplog.text
    moe = llm.engine.runner.model.model.layers[0].mlp
    inter = moe.intermediate_size
    assert moe.w13.dtype == FP8 and moe.w2.dtype == FP8
    assert moe.w13_scale.shape == (8, 2 * inter // BLOCK, 128 // BLOCK)
    # the checkpoint's bytes and scales, where they belong
    up3 = tensors[EXPERT + "3.up_proj.weight"]
    assert torch.equal(moe.w13[3, inter:].view(torch.uint8), up3.view(torch.uint8))
    assert torch.equal(moe.w13_scale[3, 1:], tensors[EXPERT + "3.up_proj.weight_scale_inv"])
    down5 = tensors[EXPERT + "5.down_proj.weight"]
    assert torch.equal(moe.w2[5].view(torch.uint8), down5.view(torch.uint8))
    assert torch.equal(moe.w2_scale[5], tensors[EXPERT + "5.down_proj.weight_scale_inv"])
    assert moe.gate.weight.dtype == torch.float32  # the router stays full precision
    compare(llm, ref, BLOCK, emulate=fake_quant_experts)


def test_dummy_fp8_moe_weights_are_fp8(moe_fp8):
    qdir, _, _ = moe_fp8
    llm = LLM(str(qdir), load_format="dummy", max_num_batched_tokens=64)
    moe = llm.engine.runner.model.model.layers[0].mlp
    assert moe.w13.dtype == FP8 and bool((moe.w13_scale > 0).all())
    out = llm.generate([[5, 6, 7]], None)[0]
    assert len(out.output.token_ids) > 0
    assert_all_blocks_free(llm)


def test_block_experts_that_blocks_do_not_tile_are_dequantized_visibly(tmp_path, caplog):
    """Experts 64 wide in 128 x 128 blocks: the gate and up halves would share a scale
    block, so the experts are dequantized to the engine dtype at load (logged), and
    compute what transformers computes on those weights (experts unquantized there,
    the attention and dense layers still W8A8)."""
    qdir, ref, tensors = write_fp8_moe_checkpoint(tmp_path, moe_intermediate_size=64)
    with caplog.at_level("WARNING"):
        llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=64)
    assert "expert weights dequantized at load" in caplog.text
    moe = llm.engine.runner.model.model.layers[0].mlp
    assert moe.w13.dtype == torch.float32 and moe.fp8_format is None
    w, s = tensors[EXPERT + "2.down_proj.weight"], tensors[EXPERT + "2.down_proj.weight_scale_inv"]
    assert torch.equal(moe.w2[2], w.float() * s.repeat_interleave(BLOCK, 1)[:, :64])
    compare(llm, ref, BLOCK)


def test_online_fp8_quantizes_the_experts_per_channel(tmp_path, caplog):
    """quantization="fp8" on a full-precision Qwen3-MoE: every expert is quantized per
    output row as it loads (the same rule as the linear layers), and the model computes
    what transformers computes on those weights (quantized here independently,
    fp8_helpers.quantize_channel) with the same per-token activation quantization."""
    from safetensors.torch import load_file, save_file

    from tests.engine.fp8_helpers import fake_quant_activations, quantize_channel

    src = save_random_moe_model(tmp_path / "src", "qwen3_moe", initializer_range=0.02)
    deq = {}
    for name, value in load_file(src / "model.safetensors").items():
        deq[name] = quantize_channel(value)[2] if is_proj(name) else value
    ref = shutil.copytree(src, tmp_path / "ref")
    save_file({k: v.contiguous() for k, v in deq.items()}, ref / "model.safetensors")
    with caplog.at_level("INFO"):
        llm = LLM(str(src), quantization="fp8", max_num_batched_tokens=64)
    assert "keep their experts in FP8" in caplog.text
    moe = llm.engine.runner.model.model.layers[0].mlp
    inter = moe.intermediate_size
    assert moe.w13.dtype == FP8 and moe.w13_scale.shape == (8, 2 * inter)
    want = deq[EXPERT + "4.gate_proj.weight"]
    got = moe.w13[4, :inter].float() * moe.w13_scale[4, :inter, None]
    assert torch.equal(got, want)  # the engine's quantization equals the independent one
    emulated = fake_quant_activations(hf_load(ref), None)
    fake_quant_experts(emulated, None)
    prompts = [[5, 9, 200, 31], list(range(3, 40)), [7] * 17]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        tokens = out.output.token_ids
        assert tokens == hf_greedy(emulated, prompt, 4, ignore_eos=True)
        ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            assert entry[token].logprob == pytest.approx(ref_lp[pos, token].item(), abs=1e-3)
    assert_all_blocks_free(llm)
