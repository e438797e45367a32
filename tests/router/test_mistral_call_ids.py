"""Mistral tool calls with the model's own call ids: v13 tokenizers (Magistral, Mistral
Small 3.2, Devstral) write `[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}` for each call, and
v3 ones may put an "id" in the JSON list. The call's id in the answer is the model's
when it wrote one (a fresh 9-character id otherwise, or when it repeats one it used),
whole-output and streamed alike, cut at every position and in random pieces; the
expected calls are written out by hand or rendered from generated data, never taken
from the parser."""

from __future__ import annotations

import json
import random
import re
import string

import pytest
from openai.types.chat import ChatCompletion

from pdpb.v1 import common_pb2, decode_pb2
from router.protocol import parse_chat_request
from router.responses import ResponseBuilder
from router.tools import make_tool_parser

FRESH = None  # the model wrote no usable id: a fresh one of 9 letters and digits
PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome"}'
CASES = [
    (f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{PARIS}", None, [("a1B2c3D4e", "get_weather", PARIS)]),
    (
        f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{PARIS}[TOOL_CALLS]get_weather[CALL_ID]Zz9Yy8Xx7[ARGS]{ROME}",
        None,
        [("a1B2c3D4e", "get_weather", PARIS), ("Zz9Yy8Xx7", "get_weather", ROME)],
    ),
    ("Let me check.\n\n[TOOL_CALLS]get_time[CALL_ID]Q0w9E8r7T[ARGS]{}\n", "Let me check.", [("Q0w9E8r7T", "get_time", "{}")]),
    # a call with an id, then one without (v11's form)
    (
        f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{PARIS}[TOOL_CALLS]get_time[ARGS]{{}}",
        None,
        [("a1B2c3D4e", "get_weather", PARIS), (FRESH, "get_time", "{}")],
    ),
    # the same id twice: the second call gets its own
    (
        f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{PARIS}[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{ROME}",
        None,
        [("a1B2c3D4e", "get_weather", PARIS), (FRESH, "get_weather", ROME)],
    ),
    # an empty id, or one with a space in it, is no id
    ("[TOOL_CALLS]get_time[CALL_ID][ARGS]{}", None, [(FRESH, "get_time", "{}")]),
    ("[TOOL_CALLS]get_time[CALL_ID]ab cd[ARGS]{}", None, [(FRESH, "get_time", "{}")]),
    # whitespace around the id (a decoded SentencePiece space) is not part of it
    ("[TOOL_CALLS]get_time[CALL_ID] k7K7k7K7k [ARGS]{}", None, [("k7K7k7K7k", "get_time", "{}")]),
    # v3's JSON list may carry ids too
    (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}, "id": "abcDEF123"}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        None,
        [("abcDEF123", "get_time", "{}"), (FRESH, "get_weather", ROME)],
    ),
    ('[TOOL_CALLS]{"name": "get_time", "arguments": {}, "id": 7}', None, [(FRESH, "get_time", "{}")]),
    # not calls: as written, in the content
    ("[TOOL_CALLS]get_time[CALL_ID]abcdefghi", "[TOOL_CALLS]get_time[CALL_ID]abcdefghi", []),  # cut before [ARGS]
    ('[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{"a": ', '[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{"a": ', []),
    ("[TOOL_CALLS]get time[CALL_ID]abcdefghi[ARGS]{}", "[TOOL_CALLS]get time[CALL_ID]abcdefghi[ARGS]{}", []),
    ("[TOOL_CALLS][CALL_ID]abcdefghi[ARGS]{}", "[TOOL_CALLS][CALL_ID]abcdefghi[ARGS]{}", []),
    ("a [CALL_ID] b [ARGS] c", "a [CALL_ID] b [ARGS] c", []),
]  # fmt: skip


def _check(calls, expected) -> None:
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [(c.name, c.arguments) for c in calls] == [(n, a) for _, n, a in expected]
    for call, (want, _, _) in zip(calls, expected):
        if want is FRESH:
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id), call.id
        else:
            assert call.id == want
    assert len({c.id for c in calls}) == len(calls)


def _streamed(text: str, cuts: list[int]):
    stream = make_tool_parser("mistral").stream()
    content, calls = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, k = stream.feed(text[a:b])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    return content + c, calls + k


@pytest.mark.parametrize("text,content,expected", CASES)
def test_the_models_call_ids_are_kept(text, content, expected):
    got_content, calls = make_tool_parser("mistral").parse(text)
    assert got_content == content
    _check(calls, expected)


@pytest.mark.parametrize("text,content,expected", CASES)
def test_streamed_ids_equal_the_whole_parse(text, content, expected):
    rng = random.Random(len(text))
    cuts_list = [list(range(1, len(text)))] + [[cut] for cut in range(len(text) + 1)]
    for _ in range(20):
        k = min(len(text) - 1, rng.randint(1, 8))
        cuts_list.append(sorted(rng.sample(range(1, len(text)), k)))
    for cuts in cuts_list:
        got_content, calls = _streamed(text, cuts)
        assert got_content == (content or ""), cuts
        _check(calls, expected)


def test_parallel_tool_calls_false_keeps_the_first_with_its_id():
    text = CASES[1][0]
    content, calls = make_tool_parser("mistral").parse(text, parallel=False)
    assert content is None
    assert [(c.id, c.name, c.arguments, c.index) for c in calls] == [
        ("a1B2c3D4e", "get_weather", PARIS, 0)
    ]


_ALNUM = string.ascii_letters + string.digits


def _random_call(rng: random.Random) -> tuple[str, str, dict]:
    name = rng.choice(["get_weather", "get_time", "search", "f", "lookup_user-2"])
    call_id = "".join(rng.choice(_ALNUM) for _ in range(9))
    args = {
        rng.choice(["city", "q", "n", "tags", "deep"]): rng.choice(
            ["Paris", "é [ARGS] ü", 3, -1.5, True, None, ["a", "[TOOL_CALLS"], {"x": {}}]
        )
        for _ in range(rng.randint(0, 3))
    }
    return call_id, name, args


@pytest.mark.parametrize("seed", range(25))
def test_generated_v13_outputs_round_trip(seed):
    """Calls rendered as a v13 tokenizer writes them (json.dumps of the arguments, as
    mistral-common encodes them), behind optional text: parsed back whole and streamed."""
    rng = random.Random(seed)
    made, count = {}, rng.randint(1, 4)
    while len(made) < count:  # distinct ids
        call_id, name, args = _random_call(rng)
        made[call_id] = (name, args)
    lead = rng.choice(["", "Sure.", "Checking [TOOL_ now:\n"])
    text = lead + "".join(
        f"[TOOL_CALLS]{name}[CALL_ID]{cid}[ARGS]{json.dumps(args, ensure_ascii=False)}"
        for cid, (name, args) in made.items()
    )
    expected = [
        (cid, name, json.dumps(args, ensure_ascii=False)) for cid, (name, args) in made.items()
    ]
    content = lead.rstrip() or None
    got_content, calls = make_tool_parser("mistral").parse(text)
    assert got_content == content
    _check(calls, expected)
    assert [json.loads(c.arguments) for c in calls] == [args for _, args in made.values()]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
    got_content, calls = _streamed(text, cuts)
    assert got_content == (content or "")
    _check(calls, expected)


def _resp(text: str, finish: int = 0):
    r = decode_pb2.GenerateResponse(text=text, token_ids=[1], finish_reason=finish)
    if finish:
        r.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=9))
    return r


def test_the_answer_and_the_stream_carry_the_models_ids():
    tool = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": [{"role": "user", "content": "Paris and Rome?"}], "tools": [tool]}
    text = CASES[1][0]
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    stop = common_pb2.FINISH_REASON_STOP
    parser = make_tool_parser("mistral")

    whole = ResponseBuilder(parse_chat_request(body), "r1", "m", None, parser)
    for i, p in enumerate(pieces):
        whole.add(0, _resp(p, stop if i == len(pieces) - 1 else 0))
    choice = ChatCompletion.model_validate(whole.response()).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("a1B2c3D4e", "get_weather", PARIS),
        ("Zz9Yy8Xx7", "get_weather", ROME),
    ]

    stream = ResponseBuilder(parse_chat_request({**body, "stream": True}), "r2", "m", None, parser)
    chunks = []
    for i, p in enumerate(pieces):
        chunks += stream.chunks(0, _resp(p, stop if i == len(pieces) - 1 else 0))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert [(t["index"], t["id"], t["function"]["arguments"]) for t in calls] == [
        (0, "a1B2c3D4e", PARIS),
        (1, "Zz9Yy8Xx7", ROME),
    ]
