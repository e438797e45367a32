"""MoE acceptance 1: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral, random weights in the published on-disk
format, equal transformers token for token (fp32, CPU) on prompts of different lengths
in one batch, with chunked prefill and with the prefix cache; logprobs within 1e-4."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import (
    assert_all_blocks_free,
    hf_greedy,
    hf_load,
    hf_logprobs,
    save_random_moe_model,
)

MAX_TOKENS = 24
LENGTHS = (1, 5, 16, 17, 40, 100, 150, 230)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_model(request, tmp_path_factory):
    path = save_random_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    return str(path), hf_load(path)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


def test_structure_follows_the_config(moe_model):
    model_dir, hf = moe_model
    llm = LLM(model_dir, num_kv_blocks=8)
    layers = llm.engine.runner.model.model.layers
    kinds = [type(layer.mlp).__name__ for layer in layers]
    model_type = hf.config.model_type
    if model_type in ("qwen3_moe", "qwen2_moe"):
        assert kinds == ["FusedMoE", "MLP", "FusedMoE"]  # mlp_only_layers=[1]
    else:
        assert kinds == ["FusedMoE"] * 3
    moe = layers[0].mlp
    # Qwen2-MoE's published checkpoints keep the top-k weights as the softmax gave them
    renormalized = model_type != "qwen2_moe"
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (8, 2, renormalized)
    if model_type == "qwen2_moe":  # a shared expert of its own width, and its gate
        assert moe.shared_expert.gate_up_proj.weight.shape == (2 * 96, 128)
        assert moe.shared_expert_gate.weight.shape == (1, 128)
        assert layers[0].self_attn.qkv_proj.bias is not None
        assert layers[0].self_attn.o_proj.bias is None
    else:
        assert moe.shared_expert is None and moe.shared_expert_gate is None
    # the router really routes: the vocabulary's embeddings spread over the experts
    from services.kernels.torch_backend import select_experts

    embeddings = llm.engine.runner.model.model.embed_tokens.weight
    _, ids = select_experts(moe.gate(embeddings), moe.top_k, moe.renormalize)
    assert len(ids.unique()) == 8


@pytest.mark.parametrize("chunk", [512, 16], ids=["one-chunk", "chunked"])
def test_greedy_batch_matches_transformers(moe_model, chunk):
    model_dir, hf = moe_model
    prompts = _prompts(1)
    llm = LLM(model_dir, block_size=16, max_num_batched_tokens=chunk)
    # EOS stops both sides (transformers' way of ignoring it bans the token instead)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.output.token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
    assert_all_blocks_free(llm)


def test_prefix_cache_and_logprobs(moe_model):
    model_dir, hf = moe_model
    shared = _prompts(2)[-1][:96]  # six full blocks every prompt starts with
    prompts = [shared + p for p in _prompts(3)]
    # the reference kernels: 1e-4 nats measures the model here, and with random weights
    # a near tie between two experts turns another summation order (the CPU's C
    # attention: 1e-6 relative, test_cpu_native.py) into a different expert, 4e-3 nats
    llm = LLM(model_dir, kernel_backend="torch", block_size=16, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    llm.generate([shared + [7]], params)  # fills the cache with the shared blocks
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens == len(shared)
        tokens = out.output.token_ids
        assert tokens == hf_greedy(hf, prompt, 8)
        reference = hf_logprobs(hf, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            want = reference[pos, token].item()
            assert entry[token].logprob == pytest.approx(want, abs=1e-4)
            top = torch.topk(reference[pos], 2)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
    assert_all_blocks_free(llm)


def test_checkpoint_lacking_an_expert_is_refused(moe_model, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir, _ = moe_model
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    gone = next(name for name in tensors if ".experts.5." in name)
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(broken), num_kv_blocks=8)


def test_dummy_load_format(moe_model):
    model_dir, _ = moe_model
    llm = LLM(model_dir, load_format="dummy", num_kv_blocks=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].output.token_ids) == 4
    assert_all_blocks_free(llm)
