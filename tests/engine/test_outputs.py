"""Engine outputs are snapshots: an output built while a request runs keeps the tokens
it had, although the engine reads them from the sequence's growing token list
(services/engine/outputs.py), and the tokens streamed step by step add up to the
final output."""

from __future__ import annotations

import pytest

from services.engine import LLMEngine, SamplingParams
from services.engine.config import EngineConfig
from services.engine.outputs import CompletionOutput
from tests.engine.helpers import assert_all_blocks_free


def test_a_source_backed_output_is_a_snapshot():
    tokens = [1, 2, 3, 10, 11]  # a 3-token prompt, then two outputs
    out = CompletionOutput(0, "ab", source=tokens, start=3)
    tokens.append(12)  # the engine's next step
    assert out.num_token_ids == 2 and out.token_ids_from(1) == [11]
    assert out.token_ids == [10, 11]
    assert out == CompletionOutput(0, "ab", [10, 11])
    with pytest.raises(ValueError, match="exactly one"):
        CompletionOutput(0, "", [1], source=[1])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_outputs_add_up_to_the_final_one(default_model_dir, async_scheduling):
    engine = LLMEngine(
        EngineConfig(model=str(default_model_dir), async_scheduling=async_scheduling)
    )
    prompt = engine.tokenize("Once upon a time")
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=1))
    seen, streamed, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            completion = out.output
            streamed.extend(completion.token_ids_from(len(streamed)))
            if out.finished:
                final = out
    assert final is not None and final.output.num_token_ids == 12
    assert streamed == final.output.token_ids
    # every earlier output still holds the tokens it had when it was made
    # (one output per step, one token each: read back now, they must still count up)
    assert [out.output.num_token_ids for out in seen] == list(range(1, 13))
    for out in seen:
        n = out.output.num_token_ids
        assert out.output.token_ids == final.output.token_ids[:n]
    assert_all_blocks_free(engine)
