"""MoE acceptance 2: Qwen3-MoE, Qwen2-MoE and Mixtral (random weights, published on-disk format)
through real prefill and decode worker processes over Mooncake TCP equal the colocated
engine token for token; blocks return to their starting count. The KV layout is the
dense one: experts change the MLP only."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import save_random_moe_model
from tests.workers.procs import worker_pair
from tests.workers.test_disaggregated import generate


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_disaggregated_equals_colocated(kind, tmp_path):
    model = str(save_random_moe_model(tmp_path / kind, kind))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 16, 33, 70, 130, 200)]
    colocated = LLM(model, num_kv_blocks=128)
    refs = [
        o.output.token_ids
        for o in colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    ]
    chunked = ("--max-num-batched-tokens", "64")  # the long prompts prefill in chunks
    with worker_pair(model, prefill_args=chunked) as (prefill, decode):
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: generate(decode, p, prefill, 12), prompts))
        for (tokens, last), ref in zip(results, refs):
            assert tokens == ref
            assert not last.timings.prefill_fallback
        assert prefill.load().kv_transfers_ok == len(prompts)
        for w in (prefill, decode):
            report = w.wait_all_blocks_free()
            assert report.num_free_blocks == report.num_total_blocks, w.role
