"""Tool calling end to end: the router with `--tool-call-parser hermes
--enable-auto-tool-choice` in front of a real decode worker (colocated, the default
SmolLM2 weights on CPU), driven by the official openai client.

The worker serves a copy of the default model whose chat template renders tools,
assistant tool calls and tool results the way Hermes / Qwen templates do. The small model
does not call tools by itself, so the test makes it: the final assistant message is left
open (continue_final_message) after two `<tool_call>` blocks, and greedy decoding writes
a third one, a real output that the router parses. tool_choice "required" and a named
function are forced through a JSON-schema constraint: their arguments validate against
tools with richer parameters (required fields, enums, bounded numbers and strings), and
the stream's deltas add up to the non-streamed calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from router.config import RouterConfig
from router.tools import make_tool_parser
from tests.router.helpers import RouterThread, http
from tests.router.test_integration import wait_ready

SERVED = "smollm2"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\nCall one as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            # no description: with one, the tiny model's greedy continuation below
            # stops writing calls
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
# the model continues the pattern with a third block
CONTINUE = dict(
    messages=[
        {"role": "user", "content": "Repeat the pattern."},
        {"role": "assistant", "content": BLOCK * 2},
    ],
    extra_body={"continue_final_message": True, "add_generation_prompt": False},
    temperature=0,
)


@pytest.fixture(scope="module")
def template_model(model, tmp_path_factory):
    from pathlib import Path

    src, dst = Path(model), tmp_path_factory.mktemp("tool-template-model")
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(TEMPLATE)
    return str(dst)


@pytest.fixture(scope="module")
def tokenizer(template_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(template_model)


@pytest.fixture(scope="module")
def decode(template_model):
    from tests.workers.procs import start_worker

    worker = start_worker("decode", model=template_model)
    try:
        yield worker
    finally:
        worker.stop()


def _router(decode, **kw):
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        decode=(decode.address,),
        served_model_name=SERVED,
        health_interval=0.5,
        **kw,
    )
    return RouterThread(cfg)


@pytest.fixture(scope="module")
def router(decode):
    with _router(decode, tool_call_parser="hermes", enable_auto_tool_choice=True) as r:
        wait_ready(r)
        yield r


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def test_the_template_receives_tools_and_tool_messages(router, client, tokenizer):
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    # the reference: transformers with the tools and the arguments as an object
    as_template = [*history[:1], json.loads(json.dumps(history[1])), history[2]]
    as_template[1]["content"] = ""
    as_template[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    prompt_tokens = []
    for messages, reference in ((QUESTION, QUESTION), (history, as_template)):
        want = tokenizer.apply_chat_template(
            reference, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(want, add_special_tokens=False)
        assert '"name": "get_weather"' in want  # the tools are in the prompt
        if messages is history:  # the call's arguments rendered as an object
            assert '"arguments": {"city": "Paris"}}' in want and "sunny, 21 C" in want
        body = {"model": SERVED, "messages": messages, "tools": TOOLS}
        got = http("POST", router.url + "/tokenize", body).json()
        assert got["tokens"] == ids
        resp = client.chat.completions.create(
            model=SERVED, messages=messages, tools=TOOLS, max_tokens=1, temperature=0
        )
        assert resp.usage.prompt_tokens == len(ids)
        prompt_tokens.append(len(ids))
    bare = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=1)
    assert bare.usage.prompt_tokens < prompt_tokens[0]


def test_a_generated_call_comes_back_as_tool_calls(client):
    # stopped right after the block: the output is exactly one call
    options = {**CONTINUE["extra_body"], "include_stop_str_in_output": True}
    resp = client.chat.completions.create(
        **{**CONTINUE, "extra_body": options},
        model=SERVED,
        tools=TOOLS,
        max_tokens=40,
        stop=["</tool_call>"],
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_streamed_calls_equal_the_whole_answer(client):
    kw = dict(model=SERVED, tools=TOOLS, max_tokens=45, **CONTINUE)
    raw = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert raw.message.tool_calls is None and raw.finish_reason == "length"
    assert raw.message.content.count("</tool_call>") >= 1, raw.message.content
    content, calls = make_tool_parser("hermes").parse(raw.message.content)
    want = [(c.name, c.arguments) for c in calls]

    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == want

    got_content, got_calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        got_content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            assert tc.index not in got_calls and tc.id.startswith("call_")  # whole calls
            got_calls[tc.index] = (tc.function.name, tc.function.arguments)
        finish = choice.finish_reason or finish
    assert (got_content or None, [got_calls[i] for i in sorted(got_calls)]) == (content, want)
    assert finish == "tool_calls"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_constrains_the_output_to_calls(client, stream):
    # a named function: its arguments, constrained to its parameters schema, end with
    # "stop"; "required": a list of calls, "tool_calls"
    for choice, finish in ((NAMED, "stop"), ("required", "tool_calls")):
        kw = dict(model=SERVED, messages=QUESTION, tools=TOOLS, tool_choice=choice)
        content, calls, got_finish = _forced(client, kw, stream)
        assert content == "" and got_finish == finish and calls, (choice, content)
        for name, arguments in calls:
            assert name == "get_weather" and isinstance(json.loads(arguments), dict)


# tools with richer parameters: required fields, enums, bounded numbers and strings
BOOK = {
    "type": "function",
    "function": {
        "name": "book_table",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string", "maxLength": 24},
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"enum": ["18:00", "19:30", "21:00"]},
                "outdoor": {"type": "boolean"},
                "budget": {"type": "number", "minimum": 10, "maximum": 500},
            },
            "required": ["restaurant", "people", "time"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                "from": {"enum": ["EUR", "USD", "GBP", "JPY"]},
                "to": {"enum": ["EUR", "USD", "GBP", "JPY"]},
                "decimals": {"type": "integer", "minimum": 0, "maximum": 4},
                "notes": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "maxItems": 2,
                },
            },
            "required": ["amount", "from", "to"],
            "additionalProperties": False,
        },
    },
}
RICH = [BOOK, CONVERT]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in RICH}
ASK_BOOK = [{"role": "user", "content": "Book a table for four at Luigi's at half past seven."}]


def _forced(client, kw: dict, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a greedy request; streamed: the
    deltas joined (a call's arguments may come in pieces, keyed by index)."""
    kw = {"max_tokens": 96, "temperature": 0, **kw}
    if not stream:
        answer = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or ()]
        return answer.message.content or "", calls, answer.finish_reason
    content, names, arguments, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.function.name:
                assert tc.index not in names and tc.id.startswith("call_")
                names[tc.index] = tc.function.name
            arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    return content, [(names[i], arguments[i]) for i in sorted(names)], finish


@pytest.mark.parametrize(
    "tool_choice,parallel",
    [
        ("required", None),
        ("required", False),
        ({"type": "function", "function": {"name": "book_table"}}, None),
        ({"type": "function", "function": {"name": "convert_currency"}}, None),
    ],
    ids=["required", "required-single", "named-book_table", "named-convert_currency"],
)
def test_forced_calls_validate_and_stream_as_they_answer(client, tool_choice, parallel):
    kw = dict(model=SERVED, messages=ASK_BOOK, tools=RICH, tool_choice=tool_choice)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    whole = _forced(client, kw, stream=False)
    content, calls, finish = whole
    assert content == "" and calls, whole
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == [tool_choice["function"]["name"]]
    if parallel is False:
        assert len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    # greedy: the stream's deltas add up to the same calls
    assert _forced(client, kw, stream=True) == whole


def test_tool_choice_refusals(decode, client):
    # a forced call is itself a constraint: not with another one
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert e.value.body["param"] == "tool_choice" and "response_format" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    # a router without --enable-auto-tool-choice refuses "auto" (the default with tools),
    # and serves "none"
    with _router(decode, tool_call_parser="hermes") as r:
        wait_ready(r)
        plain = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            plain.chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in e.value.body["message"]
        resp = plain.chat.completions.create(
            model=SERVED, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=2
        )
        assert resp.choices[0].message.tool_calls is None
