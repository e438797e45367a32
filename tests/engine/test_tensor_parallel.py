"""Tensor parallelism, acceptance 1: on CPU with gloo, real rank processes, TP=2 (and
TP=4, KV heads replicated) equal TP=1 token for token in fp32 for Llama, Qwen3 (tied
embeddings), Phi-3 (q/k/v and gate/up stored fused, split by shard and then by rank) and
the MoE families (Qwen2-MoE: q/k/v biases split with their heads, and the shared
expert's partial output summed with the routed experts' before one all-reduce), through
chunked prefill, the prefix cache, preemption and prompt logprobs; the ranks end with
the engine."""

from __future__ import annotations

import random

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import (
    assert_all_blocks_free,
    save_random_model,
    save_random_moe_model,
)

MAX_TOKENS = 12
LENGTHS = (1, 9, 16, 17, 40, 75)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
    return prompts + [prompts[-1][:48] + [5, 6, 7]]  # shares 3 blocks with the last one


@pytest.fixture(
    scope="module", params=["llama", "qwen3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral"]
)
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param in ("llama", "qwen3", "phi3"):
        return str(save_random_model(path, request.param))
    return str(save_random_moe_model(path, request.param))


# The torch kernels on both sides. The CPU default (tuned) picks each shape class's
# kernel by timing it at start, so under load (pytest -n) TP=1 and TP=2 can run other
# kernels, which moved a phi3 logprob by 2.0e-4; the tolerance is for the split itself
# (torch on both sides: at most 4.6e-5 here). tests/kernels checks each CPU kernel
# against torch.
TORCH = dict(kernel_backend="torch")
# chunked prefill (16-token chunks) and a pool too small for the whole batch: preemption
ENGINE = dict(max_num_batched_tokens=16, num_kv_blocks=12, max_model_len=112, block_size=16)
ENGINE |= TORCH
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)


def _run(model_dir: str, tp: int, params=PARAMS):
    with LLM(model_dir, tensor_parallel_size=tp, **ENGINE) as llm:
        first = llm.generate(_prompts(0), params)
        again = llm.generate(_prompts(0)[-2:], params)  # prefix-cache hits
        stats = (llm.engine.scheduler.num_preemptions, [o.num_cached_tokens for o in again])
        assert_all_blocks_free(llm)
        procs = llm.engine.runner.ranks.procs if tp > 1 else []
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs), "a rank outlived its engine"
    return first + again, stats


def _assert_same(want, got):
    for a, b in zip(want, got, strict=True):
        assert a.output.token_ids == b.output.token_ids
        for step_a, step_b in zip(a.output.logprobs, b.output.logprobs):
            for token, lp in step_a.items():
                assert abs(lp.logprob - step_b[token].logprob) < 1e-4


def test_tp2_equals_tp1(model_dir):
    want, want_stats = _run(model_dir, 1)
    got, stats = _run(model_dir, 2)
    _assert_same(want, got)
    assert stats == want_stats
    assert stats[0] > 0, "the pool was meant to force preemption"
    assert stats[1][-1] == 48  # the shared prefix came from the cache


def test_prompt_logprobs_under_tp(tmp_path):
    model_dir = str(save_random_model(tmp_path / "qwen3", "qwen3"))
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    prompts = _prompts(1)[:4]
    with LLM(model_dir, max_num_batched_tokens=7, **TORCH) as one:
        want = one.generate(prompts, params)
    with LLM(model_dir, max_num_batched_tokens=7, tensor_parallel_size=2, **TORCH) as two:
        got = two.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.output.token_ids == b.output.token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for token, lp in x.items():
                assert abs(lp.logprob - y[token].logprob) < 1e-4


def test_tp4_replicates_kv_heads(tmp_path):
    # 2 KV heads over 4 ranks: each KV head lives on two ranks
    model_dir = str(save_random_model(tmp_path / "llama", "llama"))
    prompts = _prompts(2)[:4]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_dir) as one:
        want = [o.output.token_ids for o in one.generate(prompts, params)]
    with LLM(model_dir, tensor_parallel_size=4) as four:
        spec = four.engine.runner.kv_spec
        assert (spec.num_kv_heads, spec.total_kv_heads, spec.tp_size) == (1, 2, 4)
        assert [o.output.token_ids for o in four.generate(prompts, params)] == want


def test_impossible_split_is_refused_by_name(tmp_path):
    model_dir = str(save_random_model(tmp_path / "llama", "llama"))
    with pytest.raises(ValueError, match="num_attention_heads"):  # 8 heads over 3 ranks
        LLM(model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, tensor_parallel_size=0)


def test_head_rule_matches_the_transfer_layer():
    # the engine and kvtransfer each hold the rule (neither imports the other)
    from kvtransfer.layout import kv_heads_of_rank
    from services.models.tensor_parallel import kv_head_range

    for total in (1, 2, 3, 4, 8):
        for tp in (1, 2, 3, 4, 8):
            for rank in range(tp):
                try:
                    want = kv_heads_of_rank(total, tp, rank)
                except ValueError:
                    with pytest.raises(ValueError):
                        kv_head_range(total, tp, rank)
                    continue
                assert kv_head_range(total, tp, rank) == want


def test_tuner_measures_one_ranks_shapes():
    from transformers import Qwen3MoeConfig

    from services.kernels.shape_classes import KernelShapes

    hf = Qwen3MoeConfig(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8,
    )  # fmt: skip
    shapes = KernelShapes.from_hf_config(hf, 16, "bfloat16", tp_size=8)
    assert (shapes.num_q_heads, shapes.num_kv_heads) == (4, 1)  # KV heads replicated
    assert (shapes.intermediate_size, shapes.moe_intermediate_size) == (768, 96)
