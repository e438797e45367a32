"""Issue 18, hostile input: every list and string of a request is bounded (router/bounds.py,
the router's --max-* flags), and over a limit the live router answers a 400 in OpenAI's
error shape naming the field and the limit; an oversize body is a 413 in the same shape,
never aiohttp's text/plain. The router runs without workers: a body that passes
validation gets the 503 of "no healthy workers", which shows it was not refused."""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import openai
import pytest

from router.bounds import RequestLimits, limit_fields
from router.config import RouterConfig
from router.errors import APIError
from router.protocol import parse_chat_request, parse_completion_request
from tests.router.helpers import RouterThread, assert_openai_error, http

LIMITS = RequestLimits(
    max_stop_sequences=4,
    max_stop_chars=16,
    max_bad_words=3,
    max_logit_bias=3,
    max_token_ids=8,
    max_messages=3,
    max_message_chars=32,
    max_prompts=3,
    max_choices=6,
    max_prompt_bytes=200,
    max_constraint_bytes=64,
    max_tools=2,
    max_json_depth=8,
)
BODY_LIMIT = 4096
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}"}}


def nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


@pytest.fixture(scope="module")
def router():
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        served_model_name="m",
        decode=("127.0.0.1:9",),  # never healthy: accepted bodies get a 503
        health_interval=0.2,
        health_timeout=0.5,
        max_body_bytes=BODY_LIMIT,
        limits=LIMITS,
    )
    with RouterThread(cfg) as r:
        yield r


def chat(**kw):
    return ("/v1/chat/completions", {"model": "m", "messages": MSG, **kw})


def comp(**kw):
    return ("/v1/completions", {"model": "m", "prompt": "hi", **kw})


# (request over a limit, the param named, the code, the limit in the message)
OVER = [
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length", "4"),
    (chat(stop="x" * 17), "stop[0]", "string_above_max_length", "16"),
    (comp(stop=["ok", "y" * 17]), "stop[1]", "string_above_max_length", "16"),
    (chat(stop_token_ids=[1, 2, 3, 4, 5]), "stop_token_ids", "array_above_max_length", "4"),
    (chat(bad_words=["a", "b", "c", "d"]), "bad_words", "array_above_max_length", "3"),
    (chat(bad_words=["z" * 17]), "bad_words[0]", "string_above_max_length", "16"),
    (
        chat(logit_bias={"1": 1, "2": 1, "3": 1, "4": 1}),
        "logit_bias",
        "object_above_max_length",
        "3",
    ),
    (
        chat(allowed_token_ids=list(range(9))),
        "allowed_token_ids",
        "array_above_max_length",
        "8",
    ),
    (chat(messages=MSG * 4), "messages", "array_above_max_length", "3"),
    (
        chat(messages=[{"role": "user", "content": "m" * 33}]),
        "messages[0].content",
        "string_above_max_length",
        "32",
    ),
    (
        chat(messages=[*MSG, {"role": "user", "content": [{"type": "text", "text": "p" * 20}] * 2}]),
        "messages[1].content",
        "string_above_max_length",
        "32",
    ),
    (
        chat(
            messages=[{"role": "user", "content": "c" * 32}] * 3,
            tools=[{"type": "function", "function": {"name": "f", "description": "d" * 32}}],
            tool_choice="none",
        ),
        "messages",
        "prompt_above_max_bytes",
        "200",
    ),
    (chat(tools=[tool(0), tool(1), tool(2)], tool_choice="none"), "tools", "array_above_max_length", "2"),
    (chat(chat_template_kwargs={"a": nested(7)}), "chat_template_kwargs", "nested_too_deeply", "8"),
    (chat(n=7), "n", "too_many_choices", "6"),
    (
        chat(guided_regex="r" * 65),
        "guided_regex",
        "constraint_above_max_bytes",
        "64",
    ),
    (
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "d" * 64}}}], tool_choice="required"),
        "tool_choice",
        "constraint_above_max_bytes",
        "64",
    ),
    (comp(prompt=["a", "b", "c", "d"]), "prompt", "array_above_max_length", "3"),
    (comp(prompt=[[1], [2], [3], [4]]), "prompt", "array_above_max_length", "3"),
    (comp(prompt="x" * 201), "prompt", "prompt_above_max_bytes", "200"),
    (comp(prompt=["x" * 101, "y" * 100]), "prompt", "prompt_above_max_bytes", "200"),
    (comp(prompt=["a", "b", "c"], n=3), "n", "too_many_choices", "6"),
    (comp(response_format={"type": "json_schema", "json_schema": {"schema": {"description": "s" * 64}}}), "response_format", "constraint_above_max_bytes", "64"),
    (comp(user="u" * 1025), "user", "string_above_max_length", "1024"),
    (comp(model="m" * 1025), "model", "string_above_max_length", "1024"),
    (("/tokenize", {"prompt": "t" * 201}), "prompt", "prompt_above_max_bytes", "200"),
    (("/tokenize", {"messages": MSG * 4}), "messages", "array_above_max_length", "3"),
    (("/detokenize", {"tokens": list(range(9))}), "tokens", "array_above_max_length", "8"),
    (("/detokenize", {"tokens": nested(9)}), "tokens", "nested_too_deeply", "8"),
]  # fmt: skip

# the same fields at their limits: accepted (the 503 of a router without workers)
AT = [
    chat(stop=["a", "b", "c", "d"]),
    chat(stop="x" * 16),
    chat(stop_token_ids=[1, 2, 3, 4]),
    chat(bad_words=["a", "b", "z" * 16]),
    chat(logit_bias={"1": 1, "2": 1, "3": 1}),
    chat(allowed_token_ids=list(range(8))),
    chat(messages=[{"role": "user", "content": "m" * 32}] * 3),
    chat(tools=[tool(0), tool(1)], tool_choice="none"),
    chat(chat_template_kwargs={"a": nested(6)}),
    chat(n=6),
    chat(guided_regex="r" * 64),
    comp(prompt=["a", "b", "c"], n=2),
    comp(prompt=[[1], [2], [3]]),
    comp(prompt="x" * 200),
    comp(user="u" * 1024),
    ("/tokenize", {"prompt": "t" * 200}),
    ("/detokenize", {"tokens": list(range(8))}),
]


@pytest.mark.parametrize("request_,param,code,limit", OVER)
def test_over_a_limit_is_a_400_naming_the_field_and_the_limit(router, request_, param, code, limit):
    path, body = request_
    err = assert_openai_error(http("POST", router.url + path, body), 400, param=param, code=code)
    assert err["type"] == "invalid_request_error"
    assert limit in err["message"], err


@pytest.mark.parametrize("request_", AT)
def test_at_a_limit_is_accepted(router, request_):
    path, body = request_
    assert_openai_error(http("POST", router.url + path, body), 503, code="service_unavailable")


def test_the_openai_client_sees_the_limit(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG, stop=["1", "2", "3", "4", "5"])
    assert e.value.body["param"] == "stop" and e.value.body["code"] == "array_above_max_length"
    assert "maximum length 4" in e.value.body["message"]


@pytest.mark.parametrize(
    "request_,param",
    [
        (chat(n=129), "n"),
        (chat(n=2, best_of=129), "best_of"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(prompt_logprobs=21), "prompt_logprobs"),
        (comp(logprobs=21), "logprobs"),
        (comp(max_tokens=2**32), "max_tokens"),
        (comp(seed=2**63), "seed"),
        (comp(temperature=10**400), "temperature"),  # an integer no double can hold
    ],
)
def test_fixed_bounds(router, request_, param):
    path, body = request_
    assert_openai_error(http("POST", router.url + path, body), 400, param=param)


# ----------------------------------------------------------------------------- bodies


def _raw(router, head: bytes, chunks=()) -> tuple[int, dict, bytes]:
    """A hand-written HTTP/1.1 request; (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        header, _, body = data.partition(b"\r\n\r\n")
        lines = header.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        while len(body) < int(headers.get("Content-Length", 0)):
            body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
)
def test_oversize_bodies_are_413_in_openai_shape(router, path):
    big = {"model": "m", "prompt": "x" * BODY_LIMIT}
    err = assert_openai_error(http("POST", router.url + path, big), 413, code="request_too_large")
    assert str(BODY_LIMIT) in err["message"]
    # no Content-Length: chunked, cut at the limit while reading
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
    status, headers, body = _raw(router, head, [chunk] * 6 + [b"0\r\n\r\n"])
    assert status == 413 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "request_too_large"
    # a small gzip body that inflates past the limit
    bomb = gzip.compress(b'{"prompt": "' + b"x" * 100_000 + b'"}')
    reply = http("POST", router.url + path, raw=bomb, headers={"Content-Encoding": "gzip"})
    assert_openai_error(reply, 413, code="request_too_large")


def test_compressed_bodies(router):
    """gzip and deflate bodies are read (inflated in bounded steps by the router); bad
    ones are 400s and unknown encodings 415s, all in OpenAI's shape (aiohttp's parser
    would answer them in text/plain, before the app)."""
    url = router.url + "/v1/completions"
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    for coding, data in (
        ("gzip", gzip.compress(body)),
        ("deflate", zlib.compress(body)),
        ("deflate", zlib.compress(body)[2:-4]),  # raw deflate, as some clients send it
        ("identity", body),
        ("gzip, identity", gzip.compress(body)),
    ):
        reply = http("POST", url, raw=data, headers={"Content-Encoding": coding})
        assert_openai_error(reply, 503)  # read and valid: no workers
    for data in (b"not gzip", b"x", gzip.compress(body)[:-12]):
        for coding in ("gzip", "deflate"):
            reply = http("POST", url, raw=data, headers={"Content-Encoding": coding})
            assert "request body" in assert_openai_error(reply, 400)["message"]
    reply = http("POST", url, raw=body, headers={"Content-Encoding": "br"})
    assert_openai_error(reply, 415, code="unsupported_content_encoding")


def test_deep_bodies_are_400s(router):
    url = router.url + "/v1/completions"
    # deeper than the JSON parser's recursion: refused while parsing
    deep = b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    assert_openai_error(http("POST", url, raw=deep), 400, code="nested_too_deeply")


# -------------------------------------------------------------------- legacy functions


def test_legacy_function_fields_point_at_tools(router):
    url = router.url + "/v1/chat/completions"
    body = {"model": "m", "messages": MSG, "functions": [{"name": "f", "parameters": {}}]}
    err = assert_openai_error(http("POST", url, body), 400, param="functions")
    assert "deprecated" in err["message"] and "tools" in err["message"]
    body = {"model": "m", "messages": MSG, "function_call": {"name": "f"}}
    err = assert_openai_error(http("POST", url, body), 400, param="function_call")
    assert "tool_choice" in err["message"]
    body = {"model": "m", "messages": MSG, "function_call": "auto"}
    assert_openai_error(http("POST", url, body), 400, param="function_call")
    # asking for nothing is fine, as for every refused field
    for extra in ({"functions": []}, {"functions": None}, {"function_call": "none"}):
        reply = http("POST", url, {"model": "m", "messages": MSG, **extra})
        assert_openai_error(reply, 503)
    # the legacy message shapes too
    msgs = [*MSG, {"role": "function", "name": "f", "content": "42"}]
    err = assert_openai_error(http("POST", url, {"messages": msgs}), 400, "messages[1].role")
    assert "tool" in err["message"]
    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    err = assert_openai_error(
        http("POST", url, {"messages": [*MSG, call]}), 400, "messages[1].function_call"
    )
    assert "tool_calls" in err["message"]


def test_the_openai_client_functions_argument_is_refused(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=MSG, functions=[{"name": "f", "parameters": {}}]
        )
    assert e.value.body["param"] == "functions"


# ----------------------------------------------------------------------- configuration


def test_limits_are_router_flags():
    import argparse

    from router.cli import add_router_args, config_from_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    defaults = config_from_args(p.parse_args([])).limits
    assert defaults == RequestLimits()
    names = [name for name, _, _ in limit_fields()]
    assert {"max_stop_sequences", "max_messages", "max_prompt_bytes", "max_tools"} <= set(names)
    args = p.parse_args(["--max-stop-sequences", "4", "--max-prompt-bytes", "1000"])
    cfg = config_from_args(args)
    assert cfg.limits.max_stop_sequences == 4 and cfg.limits.max_prompt_bytes == 1000
    assert cfg.limits.max_messages == RequestLimits().max_messages
    for bad in ({"max_messages": 0}, {"max_stop_chars": -1}, {"max_json_depth": 3}):
        with pytest.raises(ValueError):
            RequestLimits(**bad)
    with pytest.raises(ValueError):
        RouterConfig(limits={"max_messages": 2})


def test_default_limits_keep_worker_requests_under_grpc_4mib():
    """Every field at its default limit at once still fits the workers' gRPC message
    (4 MiB, grpc's default receive limit)."""
    lim = RequestLimits()
    per_message = lim.max_message_chars - 16
    n_messages = lim.max_prompt_bytes // (per_message + 16)
    body = {
        "messages": [{"role": "user", "content": "m" * per_message}] * n_messages,
        "stop": ["s" * lim.max_stop_chars] * lim.max_stop_sequences,
        "stop_token_ids": [2**31] * lim.max_stop_sequences,
        "bad_words": ["b" * lim.max_stop_chars] * lim.max_bad_words,
        "logit_bias": {str(2**32 - 1 - i): -99.5 for i in range(lim.max_logit_bias)},
        "allowed_token_ids": [2**32 - 1] * lim.max_token_ids,
        "guided_regex": "r" * lim.max_constraint_bytes,
        "user": "u" * 1024,
    }
    req = parse_chat_request(body)
    size = req.prompts[0].size() + req.sampling_params(0).ByteSize()
    assert size < 4 * 1024 * 1024 - 4096, size
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "x" * (lim.max_prompt_bytes + 1)})
