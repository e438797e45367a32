"""OpenAI response and stream-chunk shapes, checked against the official client's types."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdpb.v1 import common_pb2, decode_pb2
from router import sse
from router.protocol import parse_chat_request, parse_completion_request
from router.responses import ResponseBuilder

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


def lp(tok, tid, value, top=()):
    return common_pb2.TokenLogprob(
        token_id=tid,
        logprob=value,
        token=tok,
        top=[common_pb2.TopLogprob(token=t, token_id=i, logprob=v) for t, i, v in top],
    )


def resp(text, ids, finish=0, usage=None, logprobs=(), **kw):
    r = decode_pb2.GenerateResponse(text=text, token_ids=ids, finish_reason=finish, **kw)
    r.logprobs.extend(logprobs)
    if usage:
        r.usage.CopyFrom(common_pb2.Usage(**usage))
    return r


def chat_req(**kw):
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}], **kw})


def test_sse_framing():
    assert sse.event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"


def test_chat_stream_chunks():
    b = ResponseBuilder(chat_req(stream=True, stream_options={"include_usage": True}), "rid", "m")
    chunks = b.chunks(0, resp("Hel", [1]))
    chunks += b.chunks(0, resp("", [2]))  # a token with no text yet: nothing to relay
    chunks += b.chunks(0, resp("lo", [3]))
    chunks += b.chunks(
        0,
        resp(
            "",
            [],
            STOP,
            {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 2},
            stop_token_id=2,
        ),
    )
    chunks.append(b.usage_chunk())
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all(c.id == "chatcmpl-rid" and c.object == "chat.completion.chunk" for c in parsed)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert (
        chunks[3]["choices"][0]["delta"] == {}
        and chunks[3]["choices"][0]["finish_reason"] == "stop"
    )
    assert chunks[3]["choices"][0]["stop_reason"] == 2
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null until the end
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert parsed[-1].usage.total_tokens == 8


def test_chat_stream_without_usage_and_final_text():
    b = ResponseBuilder(chat_req(stream=True), "r", "m")
    chunks = b.chunks(
        0, resp("Paris.", [1, 2], LENGTH, {"prompt_tokens": 1, "completion_tokens": 2})
    )
    assert len(chunks) == 2 and all("usage" not in c for c in chunks)
    assert chunks[1]["choices"][0] == {
        "index": 0,
        "delta": {"content": "Paris."},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }


def test_chat_logprobs_and_n():
    req = chat_req(n=2, logprobs=True, top_logprobs=1)
    b = ResponseBuilder(req, "r", "m")
    u = {"prompt_tokens": 4, "completion_tokens": 1}
    b.add(1, resp("b", [7], STOP, u, [lp("b", 7, -0.5, [("b", 7, -0.5)])], stop_string="\n"))
    b.add(0, resp("a", [6], STOP, u, [lp("a", 6, float("-inf"), [("z", 9, -0.1), ("y", 8, -1)])]))
    body = b.response()
    ChatCompletion.model_validate(body)
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    c0, c1 = body["choices"]
    assert c0["message"] == {"role": "assistant", "content": "a"}
    content = c0["logprobs"]["content"][0]
    assert content["logprob"] == -9999.0  # never -inf in JSON
    assert content["bytes"] == [97] and len(content["top_logprobs"]) == 1  # top_logprobs=1
    assert c1["stop_reason"] == "\n" and c1["finish_reason"] == "stop"
    # one prompt, n=2: the prompt counts once, completions add up
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 2
    json.dumps(body, allow_nan=False)


def test_completion_echo_logprobs_and_multi_prompt():
    req = parse_completion_request({"model": "m", "prompt": ["ab", "c"], "logprobs": 1})
    b = ResponseBuilder(req, "r", "m")
    b.add(
        0,
        resp(
            "xy",
            [1, 2],
            LENGTH,
            {"prompt_tokens": 2, "completion_tokens": 2},
            [lp("x", 1, -1.0, [("q", 3, -0.25)]), lp("y", 2, -2.0, [("y", 2, -2.0)])],
        ),
    )
    b.add(
        1,
        resp(
            "z",
            [4],
            STOP,
            {"prompt_tokens": 1, "completion_tokens": 1},
            [lp("z", 4, -0.1, [("z", 4, -0.1)])],
        ),
    )
    body = b.response()
    Completion.model_validate(body)
    assert body["id"] == "cmpl-r" and body["object"] == "text_completion"
    c0 = body["choices"][0]
    assert c0["text"] == "xy" and c0["finish_reason"] == "length"
    assert c0["logprobs"] == {
        "tokens": ["x", "y"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"q": -0.25, "x": -1.0}, {"y": -2.0}],  # top-1 plus the chosen
        "text_offset": [0, 1],
    }
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3


def test_completion_echo_stream_and_token_prompt():
    req = parse_completion_request({"model": "m", "prompt": [5, 6], "echo": True, "stream": True})
    b = ResponseBuilder(req, "r", "m")
    # token-id prompt: the worker sends the prompt text (return_prompt)
    chunks = b.chunks(0, resp(" world", [9], prompt_text="hello", prompt_token_ids=[5, 6]))
    chunks += b.chunks(0, resp("", [], STOP, {"prompt_tokens": 2, "completion_tokens": 1}))
    Completion.model_validate(chunks[-1])  # mid-stream chunks have finish_reason null
    assert chunks[0]["choices"][0]["text"] == "hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text_req = parse_completion_request({"model": "m", "prompt": "hi", "echo": True})
    b = ResponseBuilder(text_req, "r", "m")
    b.add(0, resp("!", [1], STOP, {"prompt_tokens": 1, "completion_tokens": 1}))
    assert b.response()["choices"][0]["text"] == "hi!"


def test_completion_echo_with_logprobs_and_prompt_logprobs():
    req = parse_completion_request(
        {"model": "m", "prompt": "ab", "echo": True, "logprobs": 1, "prompt_logprobs": 1}
    )
    b = ResponseBuilder(req, "r", "m")
    first = resp("c", [3], STOP, {"prompt_tokens": 2, "completion_tokens": 1})
    first.logprobs.extend([lp("c", 3, -0.5, [("c", 3, -0.5)])])
    prompt = [common_pb2.TokenLogprob(token_id=1, token="a")]  # rank 0: no logprob
    prompt.append(lp("b", 2, -3.0, [("z", 7, -0.25)]))
    prompt[1].rank = 4
    first.prompt_logprobs.extend(prompt)
    b.add(0, first)
    body = b.response()
    # not Completion.model_validate: its types say float where OpenAI's API (and vLLM)
    # send null for the first echoed token; the client itself does not validate
    c = body["choices"][0]
    assert c["text"] == "abc"
    assert c["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -3.0, -0.5],
        "top_logprobs": [None, {"z": -0.25, "b": -3.0}, {"c": -0.5}],
        "text_offset": [0, 1, 2],
    }
    assert c["prompt_logprobs"] == [
        None,
        {
            "7": {"logprob": -0.25, "rank": 1, "decoded_token": "z"},
            "2": {"logprob": -3.0, "rank": 4, "decoded_token": "b"},
        },
    ]
    json.dumps(body, allow_nan=False)


def test_chat_prompt_logprobs_top_level_and_continuous_usage():
    b = ResponseBuilder(chat_req(prompt_logprobs=0), "r", "m")
    r = resp("x", [5], STOP, {"prompt_tokens": 2, "completion_tokens": 1})
    r.prompt_logprobs.extend([common_pb2.TokenLogprob(token_id=1, token="q"), lp("?", 2, -1.5)])
    r.prompt_logprobs[1].rank = 2
    b.add(0, r)
    body = b.response()
    ChatCompletion.model_validate(body)
    assert body["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -1.5, "rank": 2, "decoded_token": "?"}},
    ]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    b = ResponseBuilder(chat_req(stream=True, stream_options=opts), "r", "m")
    chunks = b.chunks(0, resp("a", [5], prompt_token_ids=[1, 2, 3]))
    chunks += b.chunks(0, resp("b", [6]))
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunks[1]["usage"]["completion_tokens"] == 1
