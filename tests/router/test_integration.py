"""Acceptance of the router issue against real processes: prefill and decode workers
(`pdserve prefill|decode`, the default SmolLM2 model) on loopback, the router app on a
free port, the official openai client. Greedy answers are compared with the colocated
engine in this process."""

from __future__ import annotations

import asyncio
import http.client as httpclient
import json
import logging
import time

import openai
import pytest

from router.config import RouterConfig
from tests.router.helpers import RouterThread, http

SERVED = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pair(model):
    from tests.workers.procs import worker_pair

    blocks = ("--num-kv-blocks", "512")
    with worker_pair(model, prefill_args=blocks, decode_args=blocks) as workers:
        yield list(workers)


def wait_ready(r: RouterThread, pairs: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(r.state.registry.usable_pairs()) < pairs:
        assert time.monotonic() < deadline, [
            w.describe() for w in r.state.registry.workers.values()
        ]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def router(pair):
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
        wait_ready(r)
        yield r


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def greedy(colocated, prompt, **kw):
    from services.engine import SamplingParams

    params = SamplingParams(temperature=0, **kw)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return colocated.chat(prompt, params)[0]
    return colocated.generate([prompt], params)[0]


def assert_all_blocks_free(workers):
    for w in workers:
        report = w.wait_all_blocks_free(timeout=5.0)
        assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked blocks"
        assert report.num_running == 0 and report.num_waiting == 0


# ----------------------------------------------------------------------------- 1. client


def test_chat_greedy_equals_colocated(client, colocated):
    ref = greedy(colocated, QUESTION, max_tokens=32)
    out = client.chat.completions.create(
        model=SERVED, messages=QUESTION, temperature=0, max_tokens=32
    )
    assert out.object == "chat.completion" and out.model == SERVED
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.output.text == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.output.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_equals_non_stream(client, colocated):
    ref = greedy(colocated, QUESTION, max_tokens=32)
    stream = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        ref.output.text
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        ref.output.token_ids
    )
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1


def test_completions_text_tokens_stream_and_echo(client, colocated):
    prompt = "The capital of France is"
    ref = greedy(colocated, prompt, max_tokens=12, ignore_eos=True)
    out = client.completions.create(
        model=SERVED, prompt=prompt, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == ref.output.text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    # the same prompt as token ids, streamed, with echo
    ids = list(ref.prompt_token_ids)
    chunks = list(
        client.completions.create(
            model=SERVED,
            prompt=ids,
            temperature=0,
            max_tokens=12,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert text == colocated.tokenizer.decode(ids) + ref.output.text
    # a list of prompts: one choice each, usage summed
    both = client.completions.create(
        model=SERVED, prompt=[prompt, "Hello"], temperature=0, max_tokens=4
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == greedy(colocated, prompt, max_tokens=4).output.text
    hello = greedy(colocated, "Hello", max_tokens=4)
    assert both.choices[1].text == hello.output.text
    assert both.usage.prompt_tokens == len(ref.prompt_token_ids) + len(hello.prompt_token_ids)


def test_stop_strings(client, colocated):
    ref = greedy(colocated, QUESTION, max_tokens=32, stop=["Paris"])
    out = client.chat.completions.create(
        model=SERVED, messages=QUESTION, temperature=0, max_tokens=32, stop=["Paris"]
    )
    assert out.choices[0].message.content == ref.output.text == "The capital of France is "
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "Paris"


def test_seed_and_n(client):
    kw = dict(model=SERVED, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=123, **kw).choices[0].text
    b = client.completions.create(seed=123, **kw).choices[0].text
    c = client.completions.create(seed=124, **kw).choices[0].text
    assert a == b
    # n choices use seed, seed + 1, ...: choice i equals a single request with seed + i
    many = client.completions.create(seed=123, n=2, **kw)
    assert [ch.text for ch in many.choices] == [a, c]
    assert many.usage.completion_tokens == sum(
        client.completions.create(seed=s, **kw).usage.completion_tokens for s in (123, 124)
    )


def test_logprobs(client, colocated):
    from services.engine import SamplingParams

    ref = colocated.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    out = client.chat.completions.create(
        model=SERVED, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref.output.token_ids)
    for entry, tid, ref_lp in zip(content, ref.output.token_ids, ref.output.logprobs):
        assert entry.logprob == pytest.approx(ref_lp[tid].logprob, abs=1e-3)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0])
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen is the top one
    # completions: logprobs=2
    comp = client.completions.create(
        model=SERVED, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) in (2, 3) for t in lp.top_logprobs)  # top-2 plus the chosen token
    assert all(v <= 0 for v in lp.token_logprobs)


def test_request_id_reaches_logs(router, caplog):
    with caplog.at_level(logging.DEBUG, logger="pdserve.router"):
        reply = http(
            "POST",
            router.url + "/v1/completions",
            {"model": SERVED, "prompt": "Hi", "max_tokens": 2, "n": 2},
            headers={"X-Request-Id": "it-req-42"},
        )
    assert reply.status == 200 and reply.headers["X-Request-Id"] == "it-req-42"
    assert reply.json()["id"] == "cmpl-it-req-42"
    lines = [r.getMessage() for r in caplog.records]
    assert any("[it-req-42]" in m and "worker request id it-req-42-1" in m for m in lines)
    assert any("[it-req-42]" in m and "done" in m and "workers=" in m for m in lines)


# ----------------------------------------------------------------------------- 2. errors


def test_errors_with_real_workers(client, router):
    limit = router.state.registry.max_model_len()  # from the workers' LoadReport
    assert limit and [m.model_extra["max_model_len"] for m in client.models.list().data] == [limit]
    # prompt + max_tokens over the context: the worker says so (text prompt)...
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=limit)
    assert "context" in e.value.body["message"]
    # ... and the router knows it for token ids
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt=[1] * 100, max_tokens=limit - 50)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt=[1] * limit, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):  # a token id outside the vocabulary
        client.completions.create(model=SERVED, prompt=[10**8], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt="x", top_p=2)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x")
    assert [m.id for m in client.models.list().data] == [SERVED]


# ----------------------------------------------------------------------------- 3. cancel


def test_client_disconnect_frees_all_blocks(router, pair):
    body = {
        "model": SERVED,
        "prompt": "Count forever: 1, 2, 3,",
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    # streaming: read a few chunks, then hang up
    conn = httpclient.HTTPConnection("127.0.0.1", router.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    conn.close()
    # not streaming: hang up while the worker is generating
    conn = httpclient.HTTPConnection("127.0.0.1", router.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while pair[1].load().num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()
    assert_all_blocks_free(pair)
    assert router.state.limit.inflight == 0
    assert all(w.inflight == 0 for w in router.state.registry.workers.values())


# ----------------------------------------------------------------------------- 5. load


def test_64_concurrent_streams(router, pair, colocated):
    prompts = [f"Request {i}: the number {i * 7} is" for i in range(8)]
    refs = [greedy(colocated, p, max_tokens=10, ignore_eos=True).output.text for p in prompts]

    async def one(client, i):
        stream = await client.completions.create(
            model=SERVED,
            prompt=prompts[i % 8],
            temperature=0,
            max_tokens=10,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(main())
    assert texts == [refs[i % 8] for i in range(64)]
    assert_all_blocks_free(pair)
    metrics = http("GET", router.url + "/metrics").body.decode()
    for name in ("time_to_first_token_seconds_count", "kv_transfer_time_seconds_count"):
        line = next(m for m in metrics.splitlines() if m.startswith(f"pdserve_router_{name}"))
        assert float(line.split()[-1]) >= 64, line


# ----------------------------------------------------------------------------- 4. pools


def test_two_by_two_round_robin_and_losing_decode_workers(model, pair):
    from tests.workers.procs import start_worker

    p0 = pair[0]
    extra = []
    try:
        extra.append(start_worker("prefill", model=model))
        extra.append(start_worker("decode", model=model))
        extra.append(start_worker("decode", model=model))
        p1, d1, d2 = extra
        cfg = RouterConfig(
            host="127.0.0.1",
            port=0,
            prefill=(p0.address, p1.address),
            decode=(d1.address, d2.address),
            prefill_policy="round_robin",
            decode_policy="round_robin",
            health_interval=30,  # only the request failures make it look again
        )
        with RouterThread(cfg) as r:
            wait_ready(r, pairs=4)
            registry = r.state.registry
            # the model name comes from the workers when no served name is given
            client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            [served] = [m.id for m in client.models.list().data]
            assert served == model

            def ask():
                out = client.completions.create(
                    model=served, prompt="The capital of France is", temperature=0, max_tokens=4
                )
                return out.choices[0].text

            answer = ask()
            for _ in range(7):
                assert ask() == answer
            assert all(w.requests >= 1 for w in registry.workers.values()), [
                w.describe() for w in registry.workers.values()
            ]
            # one decode worker dies between probes: requests that pick it are retried on
            # the other, nothing fails, and /ready stays true
            d1.proc.kill()
            d1.proc.wait()
            for _ in range(4):
                assert ask() == answer
            assert http("GET", r.url + "/ready").status == 200
            metrics = http("GET", r.url + "/metrics").body.decode()
            assert 'pdserve_router_retries_total{code="UNAVAILABLE"}' in metrics
            # the last decode worker dies mid-stream: the stream ends with an error event
            stream = client.completions.create(
                model=served,
                prompt="Count: 1, 2,",
                max_tokens=3000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with pytest.raises(openai.APIError):
                for i, _ in enumerate(stream):
                    if i == 2:
                        d2.proc.kill()
            deadline = time.monotonic() + 10
            while http("GET", r.url + "/ready").status != 503:
                assert time.monotonic() < deadline, "/ready stayed true without decode workers"
                time.sleep(0.1)
            with pytest.raises(openai.InternalServerError) as e:
                ask()
            assert e.value.status_code == 503
            assert_all_blocks_free([p0, p1])
    finally:
        for w in extra:
            w.stop()


def test_router_without_prefill_workers_runs_colocated(pair, colocated):
    """No prefill target: the decode worker prefills its own requests (greedy output
    equal to the colocated engine, no KV transfer). Adding a prefill worker through the
    admin endpoint switches to disaggregated pairs."""
    prefill, decode = pair
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=(),
        decode=(decode.address,),
        served_model_name=SERVED,
        admin_token="ops-token",  # the admin endpoints are off without one
    )
    prompt = "The capital of France is"
    ref = greedy(colocated, prompt, max_tokens=12).output.text
    with RouterThread(cfg) as r:
        wait_ready(r)
        assert http("GET", r.url + "/ready").json()["pairs"] == 1
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        transfers = prefill.load().kv_transfers_ok
        out = client.completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=12)
        assert out.choices[0].text == ref
        streamed = client.completions.create(
            model=SERVED, prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref
        assert prefill.load().kv_transfers_ok == transfers  # the prefill worker was not used
        assert _metric(r, "pdserve_router_prefill_time_seconds_count") == 0
        assert _metric(r, "pdserve_router_queue_time_seconds_count") == 0

        added = http(
            "POST",
            r.url + "/admin/workers",
            {"role": "prefill", "address": prefill.address},
            headers={"Authorization": "Bearer ops-token"},
        )
        assert added.status == 201
        deadline = time.monotonic() + 30
        while not any(p.address for _, p in r.state.registry.usable_pairs()):
            assert time.monotonic() < deadline, "the added prefill worker was never paired"
            time.sleep(0.05)
        out = client.completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=12)
        assert out.choices[0].text == ref
        assert prefill.load().kv_transfers_ok == transfers + 1
        assert _metric(r, "pdserve_router_queue_time_seconds_count") == 1
    assert_all_blocks_free(pair)


def _metric(r: RouterThread, name: str) -> float:
    for line in http("GET", r.url + "/metrics").body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
