"""Issue 18: the router's OpenAPI document (GET /openapi.json) and property-based hostile
input (hypothesis).

- The document lists every route router/routes.py registers and describes each request
  body with the fields and limits the validator uses (router/catalog.py, bounds.py).
- In process, against the parsers: whatever they accept is valid against the document's
  schema (a documented bound is enforced), every scalar value the schema allows is
  accepted, and every refusal is a 400 APIError (no other exception).
- Against a live router with real workers (the default SmolLM2, 1P1D, CPU): generated
  and malformed bodies (wrong types, huge numbers, lone surrogates, nested garbage,
  missing and unknown fields, compressed and broken bodies), odd headers, methods and
  paths. No answer is >= 500, none hangs, every error is in OpenAI's shape, an accepted
  body is valid against the document, and afterwards the stack answers a normal request
  as before with every KV block free.

Examples are derandomized (the same on every run) and capped so the module stays within
about a minute on two CPU cores, workers' start included."""

from __future__ import annotations

import gzip
import http.client as httpclient
import json
import math
import os
import string
import urllib.parse

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import catalog
from router.bounds import RequestLimits
from router.config import RouterConfig
from router.errors import APIError
from router.protocol import (
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from tests.router.helpers import RouterThread, http

SERVED = "smollm2"
# small limits, so generated lists and strings reach them (and one past them) cheaply
LIMITS = RequestLimits(
    max_stop_sequences=4,
    max_stop_chars=16,
    max_bad_words=3,
    max_logit_bias=3,
    max_token_ids=8,
    max_messages=4,
    max_message_chars=64,
    max_prompts=3,
    max_choices=4,
    max_prompt_bytes=512,
    max_constraint_bytes=256,
    max_tools=2,
    max_json_depth=8,
)
MAX_TOKENS = 4  # every generation the live fuzz asks for is capped to this
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}
SCHEMAS = {
    "chat": "ChatCompletionRequest",
    "completion": "CompletionRequest",
    "tokenize": "TokenizeRequest",
    "detokenize": "DetokenizeRequest",
}
PARSERS = {
    "chat": parse_chat_request,
    "completion": parse_completion_request,
    "tokenize": parse_tokenize_request,
    "detokenize": parse_detokenize_request,
}
# PDSERVE_FUZZ_EXAMPLES=N: N random (not derandomized) examples per property, to hunt
# for new failures by hand; CI runs the fixed, derandomized set below.
HUNT = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "0"))
SETTINGS = dict(
    deadline=None,
    derandomize=not HUNT,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def examples(n: int) -> int:
    return HUNT or n


def config(**kw) -> RouterConfig:
    return RouterConfig(host="127.0.0.1", port=0, served_model_name=SERVED, limits=LIMITS, **kw)


@pytest.fixture(scope="module")
def bare():
    """A router without workers: the document, and the in-process properties' schemas."""
    with RouterThread(config(decode=("127.0.0.1:9",), health_interval=0.2)) as r:
        yield r


class Document(dict):
    def __repr__(self) -> str:  # strategies built from it print short
        return "<the router's /openapi.json>"


@pytest.fixture(scope="module")
def doc(bare):
    reply = http("GET", bare.url + "/openapi.json")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("application/json")
    return Document(reply.json())


def validator(doc: dict, kind: str) -> jsonschema.Draft202012Validator:
    schema = {"$ref": f"#/components/schemas/{SCHEMAS[kind]}", **doc}
    return jsonschema.Draft202012Validator(schema)


# ============================================================================= document


def test_document_lists_every_route_and_field(bare, doc):
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"]
    registered = {
        (route.method.lower(), route.resource.canonical)
        for route in bare.app.router.routes()
        if route.method != "HEAD" and not route.resource.canonical.startswith("/admin/")
    }
    documented = {(m, path) for path, ops in doc["paths"].items() for m in ops}
    assert documented == registered
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
            "/tokenize", "/detokenize", "/health", "/ready", "/metrics", "/version",
            "/openapi.json"} <= set(doc["paths"])  # fmt: skip
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    # every $ref resolves
    refs = [v for v in _walk(doc) if isinstance(v, dict) and "$ref" in v]
    assert refs
    for ref in refs:
        name = ref["$ref"].removeprefix("#/components/schemas/")
        assert name in doc["components"]["schemas"], ref
    # the request bodies: exactly the fields the parsers know, with this router's limits
    for kind in ("chat", "completion"):
        schema = doc["components"]["schemas"][SCHEMAS[kind]]
        assert set(schema["properties"]) == catalog.HONOURED_FIELDS[kind] | set(catalog.UNSUPPORTED)
        assert schema["additionalProperties"] is False
        assert schema["required"] == list(catalog.REQUIRED[kind])
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == LIMITS.max_messages
    assert chat["tools"]["anyOf"][0]["maxItems"] == LIMITS.max_tools
    assert chat["stop"]["anyOf"][1]["maxItems"] == LIMITS.max_stop_sequences
    assert chat["temperature"]["maximum"] == 2.0 and chat["n"]["maximum"] == LIMITS.max_choices
    assert "deprecated" in chat["functions"]["description"]
    assert "tools" in chat["functions"]["description"]


def test_document_is_open_and_follows_the_config():
    with RouterThread(RouterConfig(host="127.0.0.1", port=0, api_keys=("k",))) as r:
        reply = http("GET", r.url + "/openapi.json")  # no key needed, as /version
        assert reply.status == 200
        props = reply.json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert props["messages"]["maxItems"] == RequestLimits().max_messages


def _walk(v):
    yield v
    if isinstance(v, dict):
        for x in v.values():
            yield from _walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from _walk(x)


# ========================================================================= strategies

_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = st.text(max_size=8) | st.lists(st.characters() | _SURROGATES, max_size=6).map("".join)
HUGE = st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400])
SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | HUGE
    | st.floats()  # nan, inf included: JSON's NaN / Infinity, which Python's json reads
    | TEXT
)
GARBAGE = st.recursive(
    SCALAR,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3),
    max_leaves=8,
)


def nested(depth: int):
    """Arrays and objects in turn, `depth` levels."""
    v: object = 0
    for level in range(depth):
        v = [v] if level % 2 else {"k": v}
    return v


DEEP = st.integers(LIMITS.max_json_depth - 2, LIMITS.max_json_depth + 2).map(nested)


def _string(s: dict, edgy: bool) -> st.SearchStrategy:
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    if s.get("pattern") == "^[0-9]+$":
        base = st.integers(0, 2**33).map(str)
    elif s.get("pattern") == "\\S":
        base = st.text(max_size=8).filter(str.strip)
    else:
        base = st.text(min_size=lo, max_size=max(lo, min(hi or 8, 8)))
    options = [base]
    if hi is not None:
        options.append(st.just("x" * hi))
        if edgy:
            options.append(st.just("y" * (hi + 1)))
    if edgy and lo:
        options.append(st.just(""))
    return st.one_of(options)


def _number(s: dict, edgy: bool, integer: bool) -> st.SearchStrategy:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum")
    open_lo = "exclusiveMinimum" in s
    excluded = set(s.get("not", {}).get("enum", ()))
    ints = st.integers(
        None if lo is None else math.floor(lo) + 1 if open_lo else math.ceil(lo),
        None if hi is None else math.floor(hi),
    )
    if integer:
        base = ints
    else:  # a number may be sent as an integer too
        base = st.floats(lo, hi, exclude_min=open_lo, allow_nan=False, allow_infinity=False) | ints
    options = [base.filter(lambda v: v not in excluded)]
    options += [st.just(e) for e in (s.get("minimum"), hi) if e is not None and e not in excluded]
    if edgy:
        step = 1 if integer else 0.5
        options += [st.just(lo - step)] if lo is not None else []
        options += [st.just(lo)] if open_lo else []
        options += [st.just(hi + step)] if hi is not None else []
        options += [st.just(e) for e in excluded]
    return st.one_of(options)


def _array(s: dict, edgy: bool) -> st.SearchStrategy:
    items = from_schema(s.get("items", {}), edgy)
    lo, hi = s.get("minItems", 0), s.get("maxItems")
    options = [st.lists(items, min_size=lo, max_size=max(lo, min(hi or 3, 3)))]
    if hi is not None and hi <= 16:
        options.append(st.lists(items, min_size=hi, max_size=hi))
        if edgy:
            options.append(st.lists(items, min_size=hi + 1, max_size=hi + 1))
    if edgy and lo:
        options.append(st.just([]))
    return st.one_of(options)


def _object(s: dict, edgy: bool) -> st.SearchStrategy:
    props = s.get("properties", {})
    required = {k: from_schema(props.get(k, {}), edgy) for k in s.get("required", ())}
    optional = {k: from_schema(v, edgy) for k, v in props.items() if k not in required}
    extra = s.get("additionalProperties", True)
    if isinstance(extra, dict) or (extra is True and not props):
        names = s.get("propertyNames")
        keys = _string(names, edgy) if names and "pattern" in names else st.text(max_size=6)
        if names and "not" in names:
            banned = set(names["not"]["enum"])
            keys = (
                keys.filter(lambda k: k not in banned)
                if not edgy
                else keys | st.sampled_from(sorted(banned))
            )
        values = from_schema(extra, edgy) if isinstance(extra, dict) else GARBAGE
        hi = s.get("maxProperties", 3)
        sizes = (
            st.integers(0, min(hi, 3)) | st.just(hi) | (st.just(hi + 1) if edgy else st.just(hi))
        )
        more = sizes.flatmap(lambda n: st.dictionaries(keys, values, min_size=n, max_size=n))
    else:
        more = st.just({})
    fixed = st.fixed_dictionaries(required, optional=optional)
    return st.tuples(fixed, more).map(lambda p: {**p[1], **p[0]})


def from_schema(s: dict, edgy: bool = False) -> st.SearchStrategy:
    """Values for the subset of JSON Schema the router's document uses: valid ones, and
    with `edgy` also ones just past each bound."""
    if "anyOf" in s or "oneOf" in s:
        return st.one_of([from_schema(x, edgy) for x in s.get("anyOf") or s["oneOf"]])
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    t = s.get("type")
    if t is None:
        return GARBAGE
    if isinstance(t, list):
        return st.one_of([from_schema({**s, "type": x}, edgy) for x in t])
    return {
        "null": lambda: st.none(),
        "boolean": lambda: st.booleans(),
        "integer": lambda: _number(s, edgy, integer=True),
        "number": lambda: _number(s, edgy, integer=False),
        "string": lambda: _string(s, edgy),
        "array": lambda: _array(s, edgy),
        "object": lambda: _object(s, edgy),
    }[t]()


PLAIN = {"messages": [{"role": "user", "content": "Hi!"}], "prompt": "Hello", "tokens": [9906]}


@st.composite
def bodies(draw, doc: dict, kind: str) -> object:
    """A request body: the required fields and a few others from the schema (valid, at
    or past their bounds), sometimes with garbage in a known field, an unknown field,
    deep nesting, a missing required field, or no object at all."""
    schema = doc["components"]["schemas"][SCHEMAS[kind]]
    if "oneOf" in schema:  # /tokenize: a prompt or a conversation
        schema = draw(st.sampled_from(schema["oneOf"]))
    shape = draw(
        st.sampled_from(
            ["fields"] * 6 + ["garbage_field", "unknown", "deep", "missing", "not_object"]
        )
    )
    if shape == "not_object":
        return draw(GARBAGE.filter(lambda v: not isinstance(v, dict)))
    props = schema["properties"]
    body = {}
    for k in schema["required"]:  # mostly a plain value: the other fields get the attention
        how = draw(st.sampled_from(["plain", "plain", "valid", "edgy"]))
        plain = st.just(PLAIN[k]) if k in PLAIN else from_schema(props[k])
        body[k] = draw(plain if how == "plain" else from_schema(props[k], edgy=how == "edgy"))
    honoured = sorted(k for k, v in props.items() if not v.get("deprecated"))
    refused = sorted(k for k, v in props.items() if v.get("deprecated"))
    names = draw(st.lists(st.sampled_from(honoured), max_size=4, unique=True))
    if refused and draw(st.integers(0, 3)) == 0:  # a refused field, maybe set to its no-op
        names.append(draw(st.sampled_from(refused)))
    for name in names:
        body[name] = draw(from_schema(props[name], edgy=draw(st.booleans())))
    if shape == "garbage_field":
        body[draw(st.sampled_from(sorted(props)))] = draw(GARBAGE | DEEP)
    elif shape == "unknown":
        body[draw(TEXT.filter(lambda k: k not in props))] = draw(GARBAGE)
    elif shape == "deep":
        body[draw(st.sampled_from(sorted(props)))] = draw(DEEP)
    elif shape == "missing" and schema["required"]:
        body.pop(schema["required"][0], None)
    return body


# =================================================================== in-process checks


def _parse(kind: str, body):
    """The parser's verdict: True (accepted) or False (a 400 APIError); any other
    exception fails the test."""
    try:
        PARSERS[kind](body, LIMITS)
    except APIError as e:
        assert e.status == 400, (e.status, e.message)
        assert e.message and isinstance(e.message, str)
        return False
    return True


@pytest.mark.parametrize("kind", list(PATHS))
def test_accepted_bodies_are_valid_against_the_document(doc, kind):
    """No documented bound or type goes unenforced: whatever a parser accepts, the
    document's schema accepts too."""
    check = validator(doc, kind)

    @settings(max_examples=examples(200), **SETTINGS)
    @given(body=bodies(doc, kind))
    def run(body):
        if _parse(kind, body):
            errors = [e.message for e in check.iter_errors(body)]
            assert not errors, (body, errors[:3])

    run()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_scalar_the_document_allows_is_accepted(doc, kind):
    """The other direction for the scalar fields (read through the same specs): any
    value the schema allows passes the parser, given the fields another one needs."""
    schema = doc["components"]["schemas"][SCHEMAS[kind]]
    base = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    companions = {
        "best_of": lambda v: {"n": v or 1},
        "top_logprobs": lambda v: {"logprobs": True},
        "min_tokens": lambda v: {"max_tokens": max(v or 1, 1)},
        "continue_final_message": lambda v: {"add_generation_prompt": not v},
    }
    scalars = sorted(catalog.SCALARS[kind])

    @settings(max_examples=examples(200), **SETTINGS)
    @given(data=st.data())
    def run(data):
        name = data.draw(st.sampled_from(scalars))
        value = data.draw(from_schema(schema["properties"][name]))
        body = {**base, **companions.get(name, lambda v: {})(value), name: value}
        assert validator(doc, kind).is_valid(body), body
        assert _parse(kind, body), body

    run()


# ========================================================================= live router


@pytest.fixture(scope="module")
def stack(model):
    from tests.router.test_integration import wait_ready
    from tests.workers.procs import worker_pair

    blocks = ("--num-kv-blocks", "256")
    with worker_pair(model, prefill_args=blocks, decode_args=blocks) as (prefill, decode):
        cfg = config(
            prefill=(prefill.address,),
            decode=(decode.address,),
            health_interval=0.5,
            health_timeout=10.0,  # two loaded CPU cores must not fail a probe
            request_timeout=20.0,
        )
        with RouterThread(cfg) as r:
            wait_ready(r)
            yield r, (prefill, decode)


REQUEST_TIMEOUT = 30  # seconds: an answer slower than this is a hang


def send(
    router, method: str, path: str, body: bytes | None, headers: dict
) -> tuple[int, dict, bytes]:
    conn = httpclient.HTTPConnection("127.0.0.1", router.port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def assert_answer(method: str, status: int, headers: dict, body: bytes, sent=None, check=None):
    assert status < 500, (status, body[:500], sent)
    if status >= 400:
        assert headers.get("Content-Type", "").startswith("application/json"), (
            status,
            headers,
            body[:200],
        )
        if method == "HEAD":
            return
        err = json.loads(body)
        assert set(err) == {"error"}, err
        e = err["error"]
        assert set(e) == {"message", "type", "param", "code"}, e
        assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str)
        assert e["param"] is None or isinstance(e["param"], str)
        assert e["code"] is None or isinstance(e["code"], str)
    elif check is not None and isinstance(sent, dict):
        errors = [e.message for e in check.iter_errors(sent)]
        assert not errors, (sent, errors[:3])  # accepted: valid against the document


def cap(kind: str, body):
    """Generation bodies ask for at most MAX_TOKENS tokens (the fuzz stays fast)."""
    if kind in ("chat", "completion") and isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_TOKENS:
                body[name] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
    return body


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


RAW = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.just(b"{"),
    st.just(b'{"messages": [}'),
    st.just(b'{"prompt": "x"} trailing'),
    st.just(b'{"prompt": 1e999999}'),
    st.just(b'{"prompt": ' + b"9" * 5000 + b"}"),
    st.just(b'{"prompt": "\\ud800"}'),
    st.just(b'{"prompt": "\xff\xfe"}'),
    st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b'{"a": ' * 3000 + b"1" + b"}" * 3000),
    st.just("\ufeff{}".encode()),
)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "text/plain", "", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/json; charset=latin-1", "*/*"]
)  # fmt: skip
HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -_./:;=,*", max_size=40)


@st.composite
def requests_(draw, doc: dict) -> tuple[str, bytes, dict, object]:
    """(kind, raw body, headers, the body as sent or None when it is not JSON)"""
    kind = draw(st.sampled_from(list(PATHS)))
    headers = {"Content-Type": draw(CONTENT_TYPES)}
    form = draw(st.sampled_from(["json"] * 8 + ["raw", "gzip", "bad_gzip"]))
    body = cap(kind, draw(bodies(doc, kind)))
    if isinstance(body, dict) and isinstance(body.get("model"), str) and draw(st.booleans()):
        body["model"] = SERVED  # else mostly a 404: no such model
    raw = draw(RAW) if form == "raw" else encode(body)
    if form == "gzip":
        raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
    elif form == "bad_gzip":
        raw, headers["Content-Encoding"] = (
            raw[:20],
            draw(st.sampled_from(["gzip", "deflate", "br", "x"])),
        )
    for name in draw(
        st.lists(
            st.sampled_from(
                [
                    "X-Request-Id",
                    "Authorization",
                    "Accept",
                    "Expect",
                    "Accept-Encoding",
                    "User-Agent",
                ]
            ),
            max_size=2,
            unique=True,
        )
    ):
        headers[name] = draw(HEADER_TEXT)
    return kind, raw, headers, body if form in ("json", "gzip") else None


def test_fuzz_the_live_stack(stack, doc):
    router, workers = stack
    client_checks = {kind: validator(doc, kind) for kind in PATHS}
    ref_body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, _, before = send(
        router, "POST", PATHS["chat"], encode(ref_body), {"Content-Type": "application/json"}
    )
    assert status == 200, before
    before = json.loads(before)["choices"][0]["message"]["content"]
    counts = {"accepted": 0, "refused": 0}

    @settings(max_examples=examples(300), **SETTINGS)
    @given(request=requests_(doc))
    def bodies_(request):
        kind, raw, headers, sent = request
        status, got, body = send(router, "POST", PATHS[kind], raw, headers)
        counts["accepted" if status < 400 else "refused"] += 1
        assert_answer("POST", status, got, body, sent, client_checks[kind])
        if status == 200 and kind in ("chat", "completion"):
            if got.get("Content-Type", "").startswith("text/event-stream"):
                assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
            else:
                assert json.loads(body)["choices"]

    bodies_()

    @settings(max_examples=examples(80), **SETTINGS)
    @given(
        method=st.sampled_from(
            ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE"]
        ),
        path=st.sampled_from(
            [
                *PATHS.values(),
                "/v1/models",
                "/v1/models/x",
                "/health",
                "/ready",
                "/version",
                "/openapi.json",
                "/metrics",
                "/admin/workers",
            ]
        )
        | TEXT.map(
            lambda p: "/" + urllib.parse.quote(p.encode("utf-8", "surrogatepass"), safe="/%")
        ),
        body=st.none() | st.binary(max_size=32),
        header=HEADER_TEXT,
    )
    def methods(method, path, body, header):
        status, got, reply = send(
            router, method, path, body, {"X-Request-Id": header, "Content-Type": "application/json"}
        )
        assert_answer(method, status, got, reply)

    methods()

    # the stack is still whole: the same greedy answer, every KV block free
    status, _, after = send(
        router, "POST", PATHS["chat"], encode(ref_body), {"Content-Type": "application/json"}
    )
    assert status == 200, after
    assert json.loads(after)["choices"][0]["message"]["content"] == before
    from tests.router.test_integration import assert_all_blocks_free

    assert_all_blocks_free(workers)
    print(f"live fuzz: {counts}")
    assert counts["accepted"] >= 10 and counts["refused"] >= 10, counts
