"""Acceptance 2 + 3: the same greedy tokens whatever the memory layout and batching
(prefix caching on/off, chunked-prefill budgets, block sizes, async scheduling, one
request at a time, preemption under a tiny KV pool), and every block is free again afterwards."""

from __future__ import annotations

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load
from tests.engine.test_greedy_reference import TEXT_PROMPTS

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def references(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = hf_load(default_model_dir)
    prompts = [tok.encode(p) for p in TEXT_PROMPTS]
    return prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


VARIANTS = {
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunk_7": dict(max_num_batched_tokens=7),
    "chunk_64": dict(max_num_batched_tokens=64),
    "block_size_1": dict(block_size=1, max_num_batched_tokens=512),
    "block_size_32": dict(block_size=32),
    "max_num_seqs_3": dict(max_num_seqs=3),
    "async_scheduling": dict(async_scheduling=True),
    "async_max_num_seqs_3": dict(async_scheduling=True, max_num_seqs=3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_reference(variant, default_model_dir, references):
    prompts, expected = references
    llm = LLM(str(default_model_dir), **VARIANTS[variant])
    outs = llm.generate(prompts, GREEDY)
    assert [o.output.token_ids for o in outs] == expected
    assert_all_blocks_free(llm)


def test_one_at_a_time_and_prefix_cache_hits(default_model_dir, references):
    prompts, expected = references
    llm = LLM(str(default_model_dir), block_size=16, enable_prefix_caching=True)
    for prompt, exp in zip(prompts, expected):
        assert llm.generate(prompt, GREEDY)[0].output.token_ids == exp
    # Second pass: every prompt of 17+ tokens now hits the prefix cache.
    for prompt, exp in zip(prompts, expected):
        out = llm.generate(prompt, GREEDY)[0]
        assert out.output.token_ids == exp
        assert out.num_cached_tokens == ((len(prompt) - 1) // 16) * 16
    # A new prompt sharing a long prefix with a cached one reuses its blocks.
    shared = prompts[-1][:100] + prompts[3]
    out = llm.generate(shared, GREEDY)[0]
    assert out.num_cached_tokens == 96
    assert_all_blocks_free(llm)


def test_preemption_under_tiny_kv_pool(default_model_dir, references):
    prompts, expected = references
    # 40 blocks x 16 tokens: the longest request alone needs ~25 blocks, so running
    # all eight at once forces preemption and recomputation.
    llm = LLM(str(default_model_dir), num_kv_blocks=40, max_model_len=640)
    outs = llm.generate(prompts, GREEDY)
    assert [o.output.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)
