"""bfloat16 on the CPU (`--dtype bfloat16`): a supported configuration whose outputs
track the fp32 engine (the CPU default, token-exact with transformers) on the default
model, SmolLM2-135M, with text prompts; blocks return to their starting count."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans to walk on the moon were",
]
TOKENS = 8
# bf16 keeps 8 bits of mantissa: each logprob moves by a few hundredths of a nat
# (measured here: mean 0.02-0.03, max ~0.3 where two tokens nearly tie); the first
# tokens of a greedy continuation agree until such a near-tie flips one.
MEAN_NATS, MAX_NATS, MIN_AGREEING = 0.1, 1.0, 6


@pytest.fixture(scope="module")
def fp32_outputs(colocated):
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    return colocated.generate(PROMPTS, params)


def test_bf16_on_the_cpu_tracks_fp32(model, fp32_outputs):
    llm = LLM(model, dtype="bfloat16")
    assert llm.engine.runner.dtype == torch.bfloat16
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    assert_all_blocks_free(llm)
    diffs, agreeing = [], 0
    for ours, ref in zip(outs, fp32_outputs):
        same = ours.output.token_ids[:4] == ref.output.token_ids[:4]
        agreeing += same
        # compare logprobs where the two continuations still agree
        for a, b, t, u in zip(
            ours.output.logprobs, ref.output.logprobs, ours.output.token_ids, ref.output.token_ids
        ):
            if t != u:
                break
            diffs.append(abs(a[t].logprob - b[t].logprob))
    assert agreeing >= MIN_AGREEING, f"{agreeing} of {len(PROMPTS)} continuations agree"
    assert diffs and sum(diffs) / len(diffs) < MEAN_NATS, diffs
    assert max(diffs) < MAX_NATS, diffs
    # and the comparison can fail: bf16 is not fp32 bit for bit
    assert max(diffs) > 0
