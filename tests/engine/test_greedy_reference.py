"""Acceptance 1: greedy output equals transformers' greedy generation token for token
(fp32, CPU), batched, for the default model and random-weight Llama / Qwen3 / Qwen2."""

from __future__ import annotations

import random

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, save_random_model

TEXT_PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three prime numbers:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Explain, step by step, why the sky appears blue during the day and red at sunset. " * 3,
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    " ".join(f"item{i}" for i in range(120)),  # a long prompt: several blocks, chunked
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    return hf_load(default_model_dir)


@pytest.fixture(scope="module")
def llm_default(default_model_dir):
    return LLM(str(default_model_dir), max_num_batched_tokens=256)


def test_default_model_batch_matches_transformers(llm_default, hf_default):
    tok = llm_default.tokenizer
    prompt_ids = [tok.encode(p) for p in TEXT_PROMPTS]
    lengths = sorted(len(p) for p in prompt_ids)
    assert lengths[0] < 16 < lengths[-1] and lengths[-1] > 256  # <1 block ... chunked
    outs = llm_default.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for ids, out in zip(prompt_ids, outs):
        expected = hf_greedy(hf_default, ids, MAX_TOKENS)
        assert out.output.token_ids == expected, tok.decode(ids)
        assert out.output.text == tok.decode(expected, skip_special_tokens=True)
    assert_all_blocks_free(llm_default)


def test_default_model_answers_paris(llm_default):
    out = llm_default.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.output.text
    assert out.output.finish_reason == "stop"
    assert_all_blocks_free(llm_default)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "phi3"])
def test_random_weight_models_match_transformers(kind, tmp_path):
    model_dir = save_random_model(tmp_path / kind, kind)
    hf = hf_load(model_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100, 150, 230)]
    llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.output.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, ignore_eos=True)
        assert out.output.finish_reason == "length"
    assert_all_blocks_free(llm)
