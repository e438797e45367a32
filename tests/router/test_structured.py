"""Structured-output request fields: each spelling (OpenAI's response_format, vLLM's
structured_outputs and guided_*) becomes one worker constraint; bad shapes and two
constraints at once are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from router import structured
from router.errors import APIError, from_grpc
from router.protocol import parse_chat_request, parse_completion_request

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TAG = {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}
FMT = {
    "type": "tag",
    "begin": "<a>",
    "content": {"type": "json_schema", "json_schema": SCHEMA},
    "end": "</a>",
}


def chat(**kw):
    return {"model": "m", "messages": MSG, **kw}


def comp(**kw):
    return {"model": "m", "prompt": "hi", **kw}


def constraint(req):
    pb = req.sampling_params(0)
    if not pb.HasField("structured_output"):
        return None
    so = pb.structured_output
    structured = so.kind in ("json", "choice", "structural_tag")
    return so.kind, (json.loads(so.spec) if structured else so.spec)


@pytest.mark.parametrize(
    "fields,want,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            ("json", SCHEMA),
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}}, ("json_object", ""), "response_format"),
        ({"response_format": {"type": "text"}}, None, None),
        ({"structured_outputs": {"json": SCHEMA}}, ("json", SCHEMA), "structured_outputs"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json", SCHEMA), "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "[a-z]+"), "structured_outputs"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"]), "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"'), "structured_outputs"),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
            ("json_object", ""),
            "structured_outputs",
        ),
        ({"guided_json": SCHEMA}, ("json", SCHEMA), "guided_json"),
        ({"guided_regex": "\\d+"}, ("regex", "\\d+"), "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"]), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"'), "guided_grammar"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, ("json", SCHEMA), "guided_json"),
        (
            {"response_format": {"type": "structural_tag", "structures": [TAG], "triggers": ["<f="]}},
            ("structural_tag", {"structures": [TAG], "triggers": ["<f="]}),
            "response_format",
        ),
        (
            {"response_format": {"type": "structural_tag", "format": FMT}},
            ("structural_tag", {"type": "structural_tag", "format": FMT}),
            "response_format",
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": FMT})}},
            ("structural_tag", {"type": "structural_tag", "format": FMT}),
            "structured_outputs",
        ),
    ],
)  # fmt: skip
def test_each_spelling_reaches_the_worker(fields, want, param):
    for parse, body in (
        (parse_chat_request, chat(**fields)),
        (parse_completion_request, comp(**fields)),
    ):
        req = parse(body)
        assert constraint(req) == want
        assert req.structured_param == param


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "probe": 1}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_grammar": ""}, "guided_grammar"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "structures": [TAG]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<"]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "format": "tag"}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "format": FMT, "triggers": ["<"]}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_shapes_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as e:
        parse_chat_request(chat(**fields))
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_two_constraints_are_refused_naming_both():
    body = chat(response_format={"type": "json_object"}, guided_regex="a+")
    with pytest.raises(APIError) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.param == "guided_regex"
    assert "response_format" in e.value.message and "guided_regex" in e.value.message
    with pytest.raises(APIError) as e:
        parse_completion_request(comp(structured_outputs={"choice": ["a"]}, guided_json=SCHEMA))
    assert "structured_outputs" in e.value.message and "guided_json" in e.value.message
    # a text response_format asks for nothing, so it goes with any constraint
    assert constraint(parse_chat_request(chat(response_format={"type": "text"}, guided_regex="a")))


def test_a_worker_refusal_names_the_field():
    import grpc

    details = "structured output (regex): invalid regex: the parenthesis is not closed"
    error = structured.name_field(
        from_grpc(grpc.StatusCode.INVALID_ARGUMENT, details, 1), details, "guided_regex"
    )
    assert error.status == 400 and error.param == "guided_regex"
    other = structured.name_field(
        from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty", 1),
        "the prompt is empty",
        "guided_regex",
    )
    assert other.param is None
