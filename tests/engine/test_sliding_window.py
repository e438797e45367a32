"""Sliding-window attention equals transformers' greedy generation token for token
(fp32, CPU): random Mistral (every layer), Qwen2 (use_sliding_window, layers from
max_window_layers on), Phi-3 (every layer), and the Qwen3 / MoE families with a window,
on prompts shorter and longer than the window, generating well past it, with chunked
prefill and with prefix-cache hits."""

from __future__ import annotations

import random

import pytest

from services.engine import LLM, SamplingParams
from services.models.sliding_window import layer_sliding_windows
from tests.engine.helpers import (
    assert_all_blocks_free,
    hf_greedy,
    hf_load,
    save_random_model,
    save_random_moe_model,
)

MAX_TOKENS = 24
LENGTHS = (1, 5, 12, 13, 30, 57)

# config overrides -> each layer's window as transformers' model applies it
DENSE = {
    "mistral": (dict(sliding_window=12), [12, 12, 12]),
    "qwen2": (
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
        [None, 16, 16],
    ),
    "phi3": (dict(sliding_window=20), [20, 20, 20]),
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


def _check(llm, hf, prompts, max_tokens=MAX_TOKENS, seen=None):
    """Greedy outputs equal transformers'; seen: its outputs already computed, by prompt."""
    seen = {} if seen is None else seen
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        if tuple(prompt) not in seen:
            seen[tuple(prompt)] = hf_greedy(hf, prompt, max_tokens, ignore_eos=True)
        assert out.output.token_ids == seen[tuple(prompt)]
    return outs


@pytest.mark.parametrize("kind", DENSE)
def test_windowed_dense_models_match_transformers(kind, tmp_path):
    overrides, windows = DENSE[kind]
    model_dir = save_random_model(tmp_path / kind, kind, **overrides)
    hf = hf_load(model_dir)
    assert layer_sliding_windows(hf.config) == windows
    # a block of 8 holds less than any window; 16 tokens a step chunk the long prompts
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=16)
    attn = llm.engine.runner.model.attention_layers()
    assert [a.sliding_window for a in attn] == windows
    prompts, seen = _prompts(1), {}
    _check(llm, hf, prompts, seen=seen)
    # the long prompts again, and grown by a few tokens: prefix-cache hits whose cached
    # keys lie mostly outside the window of the rows computed after them
    again = prompts[-2:] + [p + [7, 8, 9] for p in prompts[-2:]]
    outs = _check(llm, hf, again, seen=seen)
    assert all(out.num_cached_tokens >= 24 for out in outs)
    assert_all_blocks_free(llm)


MOE = {
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=12),  # every layer
    # transformers' Qwen2-MoE takes its layer_types; Mixtral slides everywhere
    "qwen2_moe": dict(
        use_sliding_window=True,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "mixtral": dict(sliding_window=12),
}


@pytest.mark.parametrize("kind", ["qwen3", *MOE])
def test_other_windowed_families_match_transformers(kind, tmp_path):
    if kind == "qwen3":
        overrides = dict(use_sliding_window=True, sliding_window=12, max_window_layers=2)
        model_dir = save_random_model(tmp_path / kind, kind, **overrides)
    else:
        model_dir = save_random_moe_model(tmp_path / kind, kind, **MOE[kind])
    hf = hf_load(model_dir)
    windows = layer_sliding_windows(hf.config)
    assert windows == {"qwen3": [None, None, 12], "qwen2_moe": [12, None, 12]}.get(kind, [12] * 3)
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=16)
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == windows
    _check(llm, hf, _prompts(2)[2::2], max_tokens=16)
    assert_all_blocks_free(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "triton", "tuned"])
def test_windowed_models_on_gpu_match_transformers(kind, backend, tmp_path, monkeypatch):
    # fp32 on a GPU, decode steps and mixed steps replayed as CUDA graphs: the window is
    # each layer's constant, baked into the captured launches
    import torch

    if backend != "torch":
        pytest.importorskip("triton")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM

    model_dir = save_random_model(tmp_path / kind, kind, **DENSE[kind][0])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        kernel_backend=backend,
        block_size=16,
        max_num_batched_tokens=32,
    )
    # the torch reference cannot be captured (host lengths): it runs eagerly
    assert (llm.engine.runner.graph_runner is None) == (backend == "torch")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 17, 40, 100)]
    _check(llm, hf, prompts, max_tokens=40)
    assert_all_blocks_free(llm)
