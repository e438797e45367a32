"""Acceptance 1 of issue 16: response_format json_schema (strict) on 20 generated
schemas, through the router with the official openai client, colocated and 1P1D; each
output parses and validates with jsonschema.

The schemas come from a seeded generator: nested objects, arrays with minItems and
maxItems (of leaves or of small objects), enums, integers and numbers with bounds,
strings with maxLength, required fields, additionalProperties false. Their sizes are
bounded (at most 4 properties, 2 levels, 4 items, 16 characters) so that greedy
SmolLM2-135M finishes each well inside max_tokens. One prefill + decode pair of real
workers serves both routers (the decode worker alone is the colocated one), and the 20
requests of a run go at once, so the engine batches them.

The very first token is constrained: the model's free answer starts with "```json"; a
JSON schema only lets "{" (or whitespace) through, and in 1P1D that first token is
sampled by the prefill worker (no fallback to a local prefill)."""

from __future__ import annotations

import contextlib
import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from router.config import RouterConfig
from tests.router.helpers import RouterThread
from tests.router.test_integration import wait_ready

SERVED = "smollm2"
ASK = [{"role": "user", "content": "Fill in this JSON object with realistic values."}]
SEED, COUNT = 16, 20
NAMES = [
    "name", "age", "city", "tags", "score", "id", "color", "size", "active", "price",
    "count", "level", "status", "owner", "code", "rating", "items", "title", "year", "kind",
]  # fmt: skip
WORDS = ["red", "green", "blue", "small", "large", "open", "closed", "cat", "dog", "low", "high"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum"])
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(4, 16)}
        if rng.random() < 0.3:
            schema["minLength"] = 1
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        low = rng.choice([-10.0, 0.0, 0.5, 1.0])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1.0, 10.0, 99.5])}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(WORDS, rng.randint(2, 4))}


def _array(rng: random.Random, depth: int) -> dict:
    low = rng.randint(0, 2)
    items = _object(rng, depth + 1, 2) if depth == 0 and rng.random() < 0.3 else _leaf(rng)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(1, 2)}


def _object(rng: random.Random, depth: int = 0, most: int = 4) -> dict:
    names = rng.sample(NAMES, rng.randint(1, most))
    properties = {}
    for name in names:
        r = rng.random()
        if depth == 0 and r < 0.2:
            properties[name] = _object(rng, depth + 1, 3)
        elif r < 0.4:
            properties[name] = _array(rng, depth)
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def make_schemas(seed: int = SEED, count: int = COUNT) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng) for _ in range(count)]


SCHEMAS = make_schemas()


def _walk(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if "items" in schema:
        yield from _walk(schema["items"])


def test_the_generator_is_seeded_and_covers_the_features():
    assert make_schemas() == SCHEMAS and make_schemas(SEED + 1) != SCHEMAS
    nodes = [node for schema in SCHEMAS for node in _walk(schema)]
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    objects = [n for n in nodes if n.get("type") == "object"]
    assert all(n["additionalProperties"] is False and n["required"] for n in objects)
    assert sum(any(p.get("type") == "object" for p in s["properties"].values()) for s in SCHEMAS)
    arrays = [n for n in nodes if n.get("type") == "array"]
    assert arrays and all(n["minItems"] <= n["maxItems"] <= 4 for n in arrays)
    assert any(n["items"].get("type") == "object" for n in arrays)
    assert any("enum" in n for n in nodes)
    for kind in ("integer", "number"):
        bounded = [n for n in nodes if n.get("type") == kind]
        assert bounded and all(n["minimum"] < n["maximum"] for n in bounded)
    assert all(n["maxLength"] <= 16 for n in nodes if n.get("type") == "string")


@pytest.fixture(scope="module")
def pair(model):
    from tests.workers.procs import worker_pair

    with worker_pair(model) as workers:
        yield workers


@pytest.fixture(scope="module")
def clients(pair):
    """{"colocated": client, "1P1D": client}: two routers in front of the same decode
    worker, one of them with the prefill worker."""
    prefill, decode = pair
    with contextlib.ExitStack() as stack:
        clients = {}
        for mode, prefills in (("colocated", ()), ("1P1D", (prefill.address,))):
            cfg = RouterConfig(
                host="127.0.0.1",
                port=0,
                prefill=prefills,
                decode=(decode.address,),
                served_model_name=SERVED,
                health_interval=0.5,
            )
            r = stack.enter_context(RouterThread(cfg))
            wait_ready(r)
            clients[mode] = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        yield clients


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "pair" in request.fixturenames:
        for w in request.getfixturevalue("pair"):
            report = w.wait_all_blocks_free(timeout=5.0)
            assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked"


def _ask(client: openai.OpenAI, i: int):
    return client.chat.completions.create(
        model=SERVED,
        messages=ASK,
        temperature=0,
        max_tokens=256,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"schema_{i}", "schema": SCHEMAS[i], "strict": True},
        },
    )


@pytest.mark.parametrize("mode", ["colocated", "1P1D"])
def test_every_generated_schema_validates(pair, clients, mode):
    client = clients[mode]
    free = client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=1)
    # unconstrained, the first token is not JSON: the schema has to change it
    assert not free.choices[0].message.content.lstrip().startswith("{")
    fallbacks = pair[1].load().prefill_fallbacks
    with ThreadPoolExecutor(COUNT) as pool:
        answers = list(pool.map(lambda i: _ask(client, i), range(COUNT)))
    failures = []
    for i, answer in enumerate(answers):
        choice = answer.choices[0]
        try:
            assert choice.finish_reason == "stop", choice.finish_reason
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((i, type(e).__name__, str(e)[:200], choice.message.content[:300]))
    assert not failures, failures
    # 1P1D: every first token came from the prefill worker
    assert pair[1].load().prefill_fallbacks == fallbacks
