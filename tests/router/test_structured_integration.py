"""Structured outputs through real prefill and decode processes: the prefill worker
constrains the first token, the decode worker's matcher starts after it; and through
the router with the official openai client (response_format, guided_*,
structured_outputs), bad specs answered 400 naming the field."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from router.config import RouterConfig
from services.engine import SamplingParams, StructuredOutput
from tests.router.helpers import RouterThread

SERVED = "smollm2"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def pair(model):
    from tests.workers.procs import worker_pair

    with worker_pair(model) as workers:
        yield workers


@pytest.fixture(scope="module")
def client(pair):
    prefill, decode = pair
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=(prefill.address,),
        decode=(decode.address,),
        served_model_name=SERVED,
        health_interval=0.5,
    )
    with RouterThread(cfg) as r:
        deadline = time.monotonic() + 30
        while not r.state.registry.usable_pairs():
            assert time.monotonic() < deadline, "no usable pair"
            time.sleep(0.05)
        yield openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "pair" in request.fixturenames:
        for w in request.getfixturevalue("pair"):
            report = w.wait_all_blocks_free(timeout=5.0)
            assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked"


def generate(decode, prompt_ids, sampling, prefill):
    req = decode_pb2.GenerateRequest(
        request_id=f"so-{time.monotonic_ns()}",
        token_ids=common_pb2.TokenIds(ids=prompt_ids),
        sampling_params=sampling,
        prefill_address=prefill.address,
    )
    tokens, last = [], None
    with decode.channel() as ch:
        for resp in decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=120):
            tokens.extend(resp.token_ids)
            last = resp
    return tokens, last


def test_disaggregated_json_schema_equals_colocated(pair, colocated):
    prefill, decode = pair
    prompt = colocated.apply_chat_template(ASK)
    so = StructuredOutput("json", PERSON)
    ref = colocated.generate(
        prompt, SamplingParams(temperature=0, max_tokens=64, structured_output=so)
    )[0].output
    free = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].output
    # the constraint changes the very first token, which the prefill worker samples
    assert free.token_ids[0] != ref.token_ids[0]
    sampling = common_pb2.SamplingParams(
        max_tokens=64,
        temperature=0,
        structured_output=common_pb2.StructuredOutput(kind="json", spec=so.spec),
    )
    tokens, last = generate(decode, prompt, sampling, prefill)
    assert not last.timings.prefill_fallback  # the first token came from the prefill worker
    assert tokens == ref.token_ids
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(colocated.tokenizer.decode(tokens[:-1])), PERSON)


def test_chat_response_format_json_schema_and_json_object(client):
    out = client.chat.completions.create(
        model=SERVED,
        messages=ASK,
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(
        model=SERVED,
        messages=ASK,
        max_tokens=96,
        temperature=0.8,
        seed=5,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_structural_tag_constrains_the_tagged_section(client):
    """vLLM's response_format structural_tag (xgrammar's format): the answer must be the
    tag with a JSON body that validates, whatever the model would have written."""
    fmt = {
        "type": "tag",
        "begin": "<person>",
        "content": {"type": "json_schema", "json_schema": PERSON},
        "end": "</person>",
    }
    resp = client.chat.completions.create(
        model=SERVED,
        messages=ASK,
        max_tokens=96,
        temperature=0,
        response_format={"type": "structural_tag", "format": fmt},
    )
    text = resp.choices[0].message.content
    match = re.fullmatch(r"<person>(.*)</person>", text, re.S)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), PERSON)
    assert resp.choices[0].finish_reason == "stop"


def test_completions_guided_choice_and_structured_outputs_regex(client):
    cities = ["Paris", "London", "Berlin"]
    out = client.completions.create(
        model=SERVED,
        prompt="The capital of France is",
        max_tokens=8,
        extra_body={"guided_choice": cities},
    )
    assert out.choices[0].text in cities and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=SERVED,
        prompt="My phone number is",
        max_tokens=16,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) for c in out.choices), out.choices


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_specs_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=4, extra_body=extra)
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
