"""Acceptance 4: seeded sampling reproduces, top_k=1 is greedy, stop strings cut
exactly, logprobs equal log_softmax of transformers' logits; penalties and bad input."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.sampler import Sampler, SamplingRequest
from tests.engine.helpers import assert_all_blocks_free, hf_load, hf_logprobs

PROMPTS = ["The capital of France is", "Write a short poem about the ocean:", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir))


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    assert_all_blocks_free(llm)


def test_seeded_sampling_reproduces_across_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    alone = llm.generate(PROMPTS[1], params)[0].output.token_ids
    batched = llm.generate(
        PROMPTS,
        [
            SamplingParams(temperature=0.8, max_tokens=24),
            params,
            SamplingParams(temperature=1.2, max_tokens=24, seed=7),
        ],
    )
    assert batched[1].output.token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99)
    assert llm.generate(PROMPTS[1], other_seed)[0].output.token_ids != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=20))
    assert [o.output.token_ids for o in topk1] == [o.output.token_ids for o in greedy]


def test_stop_strings_truncate_exactly(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40))[0].output
    text = base.text
    # a stop string that starts mid-token and spans a token boundary
    stop = text[11:17]
    cut = text.index(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    assert out.output.text == text[:cut]
    assert out.output.finish_reason == "stop" and out.output.stop_reason == stop
    assert len(out.output.token_ids) < len(base.token_ids)
    kept = llm.generate(
        PROMPTS[1],
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.output.text == text[: cut + len(stop)]


def test_stop_token_ids_max_tokens_min_tokens(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12))[0].output
    stop_id = base.token_ids[3]
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])
    )[0].output
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    one = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1))[0].output
    assert one.token_ids == base.token_ids[:1] and one.finish_reason == "length"
    # the chat answer ends with EOS after 8 tokens; min_tokens forbids that
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30))[0].output
    assert short.finish_reason == "stop" and len(short.token_ids) < 12
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, min_tokens=12))[0].output
    assert len(longer.token_ids) >= 12
    assert not set(longer.token_ids[:11]) & set(llm.engine.eos_token_ids)
    ignore = llm.chat(chat, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(ignore.output.token_ids) == 16 and ignore.output.finish_reason == "length"


def test_logprobs_match_transformers(llm, default_model_dir):
    hf = hf_load(default_model_dir)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, logprobs=5)
    out = llm.generate(PROMPTS[0], params)[0]
    prompt, generated = out.prompt_token_ids, out.output.token_ids
    ref = hf_logprobs(hf, prompt + generated)
    assert len(out.output.logprobs) == len(generated)
    for i, (token, entry) in enumerate(zip(generated, out.output.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_ids = row.topk(5).indices.tolist()
        assert set(top_ids) <= set(entry)
        for tid in top_ids:
            assert abs(entry[tid].logprob - row[tid].item()) < 1e-4


def test_repetition_penalty_matches_transformers(llm, default_model_dir):
    hf = hf_load(default_model_dir)
    prompt = llm.tokenizer.encode(PROMPTS[2])
    ref = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=16,
        repetition_penalty=1.3,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    ref = ref[0, len(prompt) :].tolist()
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)
    )[0]
    assert out.output.token_ids == ref[: len(out.output.token_ids)]


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.tensor([[2.0, 1.9, 0.5, -1.0]])
    req = SamplingRequest(
        SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.15, logprobs=3),
        token_ids=[3, 0, 0, 2],
        num_prompt_tokens=1,
        stop_token_ids=[],
        generator=None,
    )
    out = Sampler()(logits, [req])
    # token 0: 2.0 - 2*0.2 - 0.15 = 1.45 < 1.9, so token 1 wins
    assert out.token_ids == [1]
    # logprobs describe the raw model distribution, before penalties
    assert abs(out.logprobs[0][0] - torch.log_softmax(logits[0], -1)[1].item()) < 1e-6


def test_min_p_and_top_p_restrict_choices():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        top_p = SamplingRequest(SamplingParams(top_p=0.7), [], 0, [], gen)
        min_p = SamplingRequest(SamplingParams(min_p=0.5), [], 0, [], gen)
        out = Sampler()(torch.cat([logits, logits]), [top_p, min_p])
        assert out.token_ids[0] in (0, 1)  # 0.5 + 0.3 reaches 0.7
        assert out.token_ids[1] in (0, 1)  # 0.15 < 0.5 * 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=50), "logprobs"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_raise_value_error(llm, tmp_path):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([5] * llm.engine.max_model_len, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model-alias")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="role"):
        LLM("smollm2", role="sideways")


def test_greedy_on_bf16_cpu_logits_is_their_own_argmax_ties_included():
    """The CPU sampler takes bf16 logits' argmax in fp32 (faster, and exact): the
    chosen ids equal bf16's own argmax, the first of tied maxima included."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 1000, generator=gen).bfloat16()
    logits[3, 10] = logits[3, 700] = 9.0  # a tie: the first wins
    logits[5, :] = 1.0  # all tied
    greedy = [SamplingRequest(SamplingParams(temperature=0), [], 0, [], None) for _ in range(16)]
    tokens = Sampler().sample(logits, greedy)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[3] == 10 and tokens[5] == 0
