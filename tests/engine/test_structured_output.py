"""Structured outputs in the engine (xgrammar): JSON schema, JSON object, regex, choice
and grammar constraints hold under greedy and seeded sampling, finish the request when
the grammar is done, leave unconstrained neighbours in the batch untouched, survive
preemption, and refuse a bad spec at request time."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from services.engine import LLM, SamplingParams, StructuredOutput
from services.engine.sampler import Sampler, SamplingRequest, samples_on_device
from tests.engine.helpers import assert_all_blocks_free

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
ASK_CITY = [{"role": "user", "content": "What is the capital of France?"}]
ASK_PHONE = [{"role": "user", "content": "Make up a phone number."}]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITIES = ["Paris", "London", "Rome", "Berlin"]


def params(so: StructuredOutput | None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 64, **kw}, structured_output=so)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir))


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    assert_all_blocks_free(llm)


def prompt(llm, conversation):
    return llm.apply_chat_template(conversation)


SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=50, seed=11)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_every_kind_holds(llm, sampling):
    cases = [
        (ASK_PERSON, StructuredOutput("json", PERSON)),
        (ASK_PERSON, StructuredOutput("json_object")),
        (ASK_PHONE, StructuredOutput("regex", PHONE)),
        (ASK_CITY, StructuredOutput("choice", CITIES)),
        (ASK_CITY, StructuredOutput("grammar", 'root ::= "The answer is " ("yes" | "no") "."')),
    ]
    outs = llm.generate(
        [prompt(llm, conv) for conv, _ in cases], [params(so, **sampling) for _, so in cases]
    )
    texts = [o.output.text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(PHONE, texts[2]), texts[2]
    assert texts[3] in CITIES
    assert re.fullmatch(r"The answer is (yes|no)\.", texts[4]), texts[4]
    for o in outs:
        # the grammar ends with the stop token: the request stops there, well short of
        # max_tokens
        assert o.output.finish_reason == "stop", o.output
        assert o.output.token_ids[-1] in llm.engine.eos_token_ids


def test_grammar_end_stops_even_with_ignore_eos(llm):
    """With ignore_eos the EOS does not stop a request, but the grammar's end does."""
    so = StructuredOutput("choice", CITIES)
    out = llm.generate(prompt(llm, ASK_CITY), params(so, ignore_eos=True))[0].output
    assert out.text in CITIES and out.finish_reason == "stop" and out.stop_reason is None
    free = llm.generate(prompt(llm, ASK_CITY), params(None, ignore_eos=True, max_tokens=8))
    assert len(free[0].output.token_ids) == 8  # unconstrained, it would go on


def test_neighbours_in_the_batch_are_unaffected(llm):
    plain = [params(None, max_tokens=24), params(None, max_tokens=24, **SAMPLED)]
    prompts = [prompt(llm, ASK_PERSON), prompt(llm, ASK_CITY)]
    alone = [llm.generate(p, sp)[0].output.token_ids for p, sp in zip(prompts, plain)]
    constrained = [
        params(StructuredOutput("json", PERSON)),
        params(StructuredOutput("regex", PHONE), **SAMPLED),
    ]
    mixed = llm.generate(prompts + prompts, plain + constrained)
    assert [o.output.token_ids for o in mixed[:2]] == alone
    assert mixed[0].output.token_ids != mixed[2].output.token_ids


def test_logprobs_are_those_of_the_masked_distribution(llm):
    """As vLLM (the grammar bitmask is applied before its sampler): every reported
    alternative is allowed, and the chosen token's logprob is renormalized."""
    so = StructuredOutput("regex", r"[0-9]{4}")
    digits = prompt(llm, ASK_PHONE)
    out = llm.generate(digits, params(so, logprobs=5))[0].output
    assert re.fullmatch(r"[0-9]{4}", out.text)
    for token, entry in zip(out.token_ids, out.logprobs[:-1]):  # the last is EOS
        finite = [lp for lp in entry.values() if lp.logprob > float("-inf")]
        assert all(lp.decoded_token.isdigit() for lp in finite)
        assert entry[token].rank == 1  # greedy within the allowed tokens
    # the same token's logprob in the model's own distribution, as a prompt token
    first = out.token_ids[0]
    raw = llm.generate(digits + [first], params(None, prompt_logprobs=0, max_tokens=1))[0]
    assert raw.prompt_logprobs[-1][first].rank > 1  # unconstrained, another token leads
    assert out.logprobs[0][first].logprob > raw.prompt_logprobs[-1][first].logprob


def test_sampler_masks_before_logprobs_and_keeps_the_grammar_alive():
    vocab = 64
    logits = torch.randn(1, vocab).repeat(2, 1)
    allowed = [3, 7, 40]
    words = torch.zeros(2, dtype=torch.int32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # allowed_token_ids that exclude the grammar's tokens: the grammar wins
    sp = SamplingParams(temperature=0, logprobs=2, allowed_token_ids=[5])
    bias = torch.full((vocab,), float("-inf"))
    bias[5] = 0.0
    reqs = [
        SamplingRequest(sp, [1], 1, [], None, grammar_bitmask=words),
        SamplingRequest(sp, [1], 1, [], None, logits_bias=bias, grammar_bitmask=words),
    ]
    out = Sampler()(logits.clone(), reqs)
    want = torch.log_softmax(logits[0, allowed], dim=-1)
    best = allowed[int(want.argmax())]
    assert out.token_ids == [best, best]
    chosen, rank, top = out.logprobs[0]
    assert rank == 1 and chosen == pytest.approx(float(want.max()), abs=1e-5)
    assert {t for t, _ in top} <= set(allowed)
    constrained = params(StructuredOutput("json_object"))
    assert not samples_on_device(constrained, 0, False)  # the host masks each step


def test_preemption_and_async_scheduling_keep_the_matcher_valid(llm, default_model_dir):
    """A pool too small for the batch preempts and recomputes sequences: the output
    tokens are kept, so each matcher, which saw exactly those, stays valid. Async
    scheduling never pipelines a batch holding a constrained request."""
    convs = [ASK_PERSON, ASK_PHONE, ASK_PERSON, ASK_CITY]
    prompts = [prompt(llm, c) for c in convs]
    sps = [
        params(StructuredOutput("json", PERSON)),
        params(StructuredOutput("regex", PHONE)),
        params(None, max_tokens=40, ignore_eos=True),
        params(StructuredOutput("json_object")),
    ]
    expected = [o.output.token_ids for o in llm.generate(prompts, sps)]
    blocks = sum(len(p) for p in prompts) // 16 + 2
    with LLM(str(default_model_dir), num_kv_blocks=blocks, async_scheduling=True) as small:
        outs = small.generate(prompts, sps)
        assert small.engine.scheduler.num_preemptions > 0
        assert_all_blocks_free(small)
    assert [o.output.token_ids for o in outs] == expected
    jsonschema.validate(json.loads(outs[0].output.text), PERSON)


@pytest.mark.parametrize(
    "so,match",
    [
        (lambda: StructuredOutput("json", {"type": "object", "properties": 5}), "JSON schema"),
        (lambda: StructuredOutput("json", {"type": "nonsense"}), "JSON schema"),
        (lambda: StructuredOutput("json", "{not json"), "not valid JSON"),
        (lambda: StructuredOutput("json", [1]), "must be an object"),
        (lambda: StructuredOutput("regex", "(abc"), "invalid regex"),
        (lambda: StructuredOutput("regex", ""), "must not be empty"),
        (lambda: StructuredOutput("grammar", "root ::= "), "invalid grammar"),
        (lambda: StructuredOutput("grammar", 'start ::= "a"'), "invalid grammar"),
        (lambda: StructuredOutput("choice", []), "non-empty list"),
        (lambda: StructuredOutput("json_object", "{}"), "takes no spec"),
        (lambda: StructuredOutput("xml", "<a/>"), "kind must be one of"),
    ],
)
def test_bad_specs_are_refused_at_request_time(llm, so, match):
    with pytest.raises(ValueError, match=match) as e:
        llm.generate("Hi", params(so()))
    assert str(e.value).startswith("structured output")  # the router names its field


def test_the_constraint_round_trips_through_the_worker_request():
    from services.common import convert

    so = StructuredOutput("choice", ["a", "b"])
    pb = convert.structured_output_to_pb(so)
    assert (pb.kind, pb.spec) == ("choice", '["a", "b"]')
    sampling = convert.sampling_params_from_pb(
        convert.common_pb2.SamplingParams(structured_output=pb)
    )
    assert sampling.structured_output == so
    assert (
        convert.sampling_params_from_pb(convert.common_pb2.SamplingParams()).structured_output
        is None
    )


def test_compiled_grammars_are_cached(llm):
    grammars = llm.engine.grammars
    so = StructuredOutput("regex", "[a-z]{2}")
    first = grammars.compile(so)
    assert grammars.compile(StructuredOutput("regex", "[a-z]{2}")) is first
    assert len(grammars) <= 128


def test_a_model_without_tokenizer_refuses(tmp_path):
    from tests.engine.helpers import save_random_model

    with LLM(str(save_random_model(tmp_path / "m", "llama"))) as tiny:
        assert tiny.tokenizer is None
        with pytest.raises(ValueError, match="needs a tokenizer"):
            tiny.generate([1, 2, 3], params(StructuredOutput("choice", ["a"])))
        assert_all_blocks_free(tiny)
