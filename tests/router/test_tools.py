"""Tool calling in the router: the hermes, llama3_json and mistral parsers on fixed outputs, the
streaming parser cut at every position and in random pieces (it must give what the
whole-output parse gives), request validation (400s naming the field), the tool fields'
trip through the Conversation to the template's messages, and the response assembly
(message.tool_calls, finish_reason, stream deltas) checked with the openai client's
types."""

from __future__ import annotations

import json
import random
import re

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdpb.v1 import common_pb2, decode_pb2
from router.config import RouterConfig
from router.errors import APIError
from router.protocol import parse_chat_request
from router.reasoning import make_reasoning_parser
from router.responses import ResponseBuilder
from router.tools import check_tool_choice, make_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


PARIS, ROME = (
    hermes_call("get_weather", {"city": "Paris"}),
    hermes_call("get_weather", {"city": "Rome"}),
)
HERMES = [
    (PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    (PARIS + "\n" + ROME, None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    # text around calls stays; the whitespace that only separates it from them goes
    ("Let me check.\n\n" + PARIS + "\nDone.", "Let me check.\n\nDone.", [("get_weather", '{"city": "Paris"}')]),
    # a malformed block stays in the content as written, the good one is a call
    ("<tool_call>{'name': oops}</tool_call>\n" + PARIS, "<tool_call>{'name': oops}</tool_call>", [("get_weather", '{"city": "Paris"}')]),
    # cut off by max_tokens: a whole JSON still counts, a partial one is content
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"é\\"}"}</tool_call>', None, [("f", '{"a": "é"}')]),
    ("No tools needed.\n", "No tools needed.\n", []),
    ("a <tool_ b", "a <tool_ b", []),
]  # fmt: skip
LLAMA = [
    ('{"name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"tz": "CET"}}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    ),
    ('  {"name": "get_time", "parameters": {}}\n', None, [("get_time", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "get_time", "parameters": {}', '{"name": "get_time", "parameters": {}', []),
    ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ("The weather is fine. {", "The weather is fine. {", []),
]  # fmt: skip
# Mistral: v3 tokenizers write a JSON list after [TOOL_CALLS] (Mistral-7B-Instruct-v0.3,
# Mixtral-8x22B: with a space after the token once decoded), v11+ ones one call per
# [TOOL_CALLS]name[ARGS]{...} (Mistral Small 3.2, Magistral, Devstral)
MISTRAL = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [("get_weather", '{"city": "Paris"}')]),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ('[TOOL_CALLS]{"name": "get_time", "arguments": {"tz": "CET"}}', None, [("get_time", '{"tz": "CET"}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("Let me check.\n\n[TOOL_CALLS]get_time[ARGS]{}\n", "Let me check.", [("get_time", "{}")]),
    # a malformed block stays in the content as written, the good one is a call
    ("[TOOL_CALLS]oops [TOOL_CALLS]get_time[ARGS]{}", "[TOOL_CALLS]oops", [("get_time", "{}")]),
    ("[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS]get time[ARGS]{}", []),
    ('[TOOL_CALLS]f[ARGS]{"a": 1} and more', '[TOOL_CALLS]f[ARGS]{"a": 1} and more', []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"answer": 42}]', '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"answer": 42}]', []),
    # cut off by max_tokens: a partial call is content
    ('[TOOL_CALLS][{"name": "get_time", "argu', '[TOOL_CALLS][{"name": "get_time", "argu', []),
    ('[TOOL_CALLS]f[ARGS]{"a": "é", "b": [1, 2]}', None, [("f", '{"a": "é", "b": [1, 2]}')]),
    ("No tools needed.\n", "No tools needed.\n", []),
    ("a [TOOL_ b [TOOL_CALLS", "a [TOOL_ b [TOOL_CALLS", []),
]  # fmt: skip
CASES = (
    [("hermes", *c) for c in HERMES]
    + [("llama3_json", *c) for c in LLAMA]
    + [("mistral", *c) for c in MISTRAL]
)


def _calls(calls) -> list[tuple[str, str]]:
    assert [c.index for c in calls] == list(range(len(calls)))
    return [(c.name, c.arguments) for c in calls]


def streamed(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list]:
    """(content, [(name, arguments)]) of `text` fed in the pieces that `cuts` make."""
    stream = make_tool_parser(parser_name).stream()
    content, calls = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, k = stream.feed(text[a:b])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    return content + c, _calls(calls + k)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_fixed_outputs(name, text, content, calls):
    got_content, got_calls = make_tool_parser(name).parse(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    # Mistral's templates accept only ids of 9 letters and digits
    ids = r"[A-Za-z0-9]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(ids, c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streaming_gives_the_whole_parse(name, text, content, calls):
    whole = (content or "", calls)
    assert streamed(name, text, list(range(1, len(text)))) == whole  # char by char
    for cut in range(len(text) + 1):
        assert streamed(name, text, [cut]) == whole, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        assert streamed(name, text, cuts) == whole, cuts


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", PARIS + "\n" + ROME),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ],
)  # fmt: skip
def test_parallel_tool_calls_false_keeps_the_first(name, text):
    content, calls = make_tool_parser(name).parse(text, parallel=False)
    assert content is None and _calls(calls) == [("get_weather", '{"city": "Paris"}')]


# ------------------------------------------------------------------ requests


def chat(**kw):
    return {"model": "m", "messages": USER, "tools": [WEATHER], **kw}


def assistant_calls(*calls):
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
ERRORS = [
    (chat(tools={"a": 1}), "tools"),
    (chat(tools=[{"type": "retrieval"}]), "tools[0]"),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    (chat(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters"),
    (chat(tool_choice="sometimes"), "tool_choice"),
    (chat(tool_choice="required", guided_regex="a+"), "tool_choice"),  # two constraints
    (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),  # no tools
    (chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (chat(messages=[*USER, {"role": "tool", "content": "sunny"}]), "messages[1].tool_call_id"),
    (chat(messages=[*USER, assistant_calls({**CALL, "id": 1})]), "messages[1].tool_calls[0].id"),
    (chat(messages=[*USER, assistant_calls({"id": "c1"})]), "messages[1].tool_calls[0]"),
    (
        chat(messages=[*USER, assistant_calls({**CALL, "function": {"name": "f", "arguments": "{x"}})]),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (chat(messages=[{"role": "user", "content": "q", "tool_calls": [CALL]}]), "messages[0].tool_calls"),
    (chat(messages=[*USER, {"role": "assistant", "content": None}]), "messages[1].content"),
    (chat(functions=[{"name": "f"}]), "functions"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", ERRORS)
def test_bad_tool_requests_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_choice_defaults_and_the_operator_flags():
    assert parse_chat_request(chat()).tool_choice == "auto"
    assert parse_chat_request({"messages": USER}).tool_choice == "none"
    none = parse_chat_request(chat(tool_choice="none", parallel_tool_calls=False))
    assert (none.tool_choice, none.parallel_tool_calls) == ("none", False)
    assert none.prompts[0].tools == [WEATHER]  # vLLM's default: the template sees them
    with pytest.raises(APIError) as e:
        check_tool_choice("auto", None)
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    check_tool_choice("none", None)
    check_tool_choice("auto", make_tool_parser("hermes"))
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        RouterConfig(decode=("127.0.0.1:1",), enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool_call_parser 'pythonic'"):
        RouterConfig(decode=("127.0.0.1:1",), tool_call_parser="pythonic")
    RouterConfig(decode=("127.0.0.1:1",), tool_call_parser="mistral")


def test_tool_fields_reach_the_template_messages():
    from services.common.convert import chat_messages_from_pb

    messages = [
        *USER,
        assistant_calls({**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}),
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]  # fmt: skip
    req = parse_chat_request(chat(messages=messages, tools=[WEATHER, TIME]))
    pb = req.prompts[0].conversation_pb()
    assert json.loads(pb.tools_json) == [WEATHER, TIME]
    got, tools = chat_messages_from_pb(pb)
    assert tools == [WEATHER, TIME]
    assert got == [
        USER[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    # objects, as templates expect (they write `arguments | tojson`)
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    # a conversation without tool fields sends none
    plain = parse_chat_request({"messages": USER}).prompts[0].conversation_pb()
    assert plain.tools_json == "" and list(plain.message_tools_json) == []
    assert chat_messages_from_pb(plain) == (USER, None)


# ------------------------------------------------------------------ responses


def _resp(text: str, finish: int = 0):
    r = decode_pb2.GenerateResponse(text=text, token_ids=[1], finish_reason=finish)
    if finish:
        r.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=9))
    return r


def _stream(builder: ResponseBuilder, pieces: list[str], index: int = 0) -> list[dict]:
    chunks = []
    for i, p in enumerate(pieces):
        finish = common_pb2.FINISH_REASON_STOP if i == len(pieces) - 1 else 0
        chunks += builder.chunks(index, _resp(p, finish))
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return [c["choices"][0] for c in chunks]


def test_response_and_stream_carry_tool_calls():
    text = "<think>hmm</think>I'll look.\n" + PARIS + "\n" + ROME
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    parser = make_tool_parser("hermes")
    reasoning = make_reasoning_parser("deepseek_r1")

    whole = ResponseBuilder(parse_chat_request(chat()), "r1", "m", reasoning, parser)
    for i, p in enumerate(pieces):
        whole.add(0, _resp(p, common_pb2.FINISH_REASON_STOP if i == len(pieces) - 1 else 0))
    body = whole.response()
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll look." and choice.message.reasoning_content == "hmm"
    calls = [
        (c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert [c[1:] for c in calls] == [
        ("function", "get_weather", '{"city": "Paris"}'),
        ("function", "get_weather", '{"city": "Rome"}'),
    ]

    stream = ResponseBuilder(parse_chat_request(chat(stream=True)), "r2", "m", reasoning, parser)
    choices = _stream(stream, pieces)
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("content") or "" for d in deltas) == "I'll look."
    streamed_calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert [(t["index"], t["function"]["name"], t["function"]["arguments"]) for t in streamed_calls] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_weather", '{"city": "Rome"}'),
    ]  # fmt: skip
    assert all(t["id"].startswith("call_") and t["type"] == "function" for t in streamed_calls)
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_no_parsing_without_auto_and_plain_answers_unchanged():
    parser = make_tool_parser("hermes")
    # tool_choice "none": the output is content, tags and all
    req = parse_chat_request(chat(tool_choice="none"))
    b = ResponseBuilder(req, "r", "m", None, parser)
    b.add(0, _resp(PARIS, common_pb2.FINISH_REASON_STOP))
    choice = b.response()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (PARIS, "stop")
    assert "tool_calls" not in choice["message"]
    # auto, but the model answered in text: the answer as it is
    b = ResponseBuilder(parse_chat_request(chat()), "r", "m", None, parser)
    b.add(0, _resp("", common_pb2.FINISH_REASON_STOP))
    assert b.response()["choices"][0]["message"]["content"] == ""
    choices = _stream(
        ResponseBuilder(parse_chat_request(chat(stream=True)), "s", "m", None, parser),
        ["Sun", "ny.\n"],
    )
    assert "".join(c["delta"].get("content", "") for c in choices) == "Sunny.\n"
    assert choices[-1]["finish_reason"] == "stop"


def test_forced_tool_choice_becomes_a_json_constraint():
    import json

    from router.protocol import parse_chat_request

    named = parse_chat_request(
        chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    so = named.sampling["structured_output"]
    assert (named.tool_choice, named.tool_choice_name) == ("named", "get_weather")
    assert so.kind == "json" and json.loads(so.spec) == WEATHER["function"]["parameters"]
    required = parse_chat_request(chat(tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.sampling["structured_output"].spec)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    [call] = schema["items"]["anyOf"]
    assert call["properties"]["name"] == {"const": "get_weather"}


def test_forced_stream_turns_the_json_into_calls():
    from router.tools import ForcedToolParser

    content, calls = ForcedToolParser("get_weather").parse('{"city": "Paris"}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls = ForcedToolParser(None).parse(text)
    assert content is None and [(c.name, c.index) for c in calls] == [("a", 0), ("b", 1)]
    # cut short by max_tokens: not JSON, so the text comes back as content
    assert ForcedToolParser("get_weather").parse('{"city": "Par') == ('{"city": "Par', [])
