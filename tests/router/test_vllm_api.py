"""vLLM's extra endpoints and chat options against a real decode worker (colocated, the
default SmolLM2 weights on CPU) through the router, with the official openai client:
/tokenize <-> /detokenize, /version, /v1/models/{model}, chat_template_kwargs,
continue_final_message, a reasoning parser, and the vllm: metrics.

The worker serves a copy of the default model whose chat template reads a kwarg the way
Qwen3's does: with enable_thinking false the generation prompt ends with an empty
`<think>\\n\\n</think>\\n\\n` block."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tests.router.helpers import RouterThread, assert_openai_error, http
from tests.router.test_integration import wait_ready

SERVED = "smollm2"
KWARG_TEMPLATE = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A pattern the model continues: its next tokens close the open <think> block.
PATTERN = "<think>\nThe user asks about France.\n</think>\nParis.\n"
CONTINUE = [
    {"role": "user", "content": "Repeat the pattern."},
    {"role": "assistant", "content": PATTERN * 2 + "<think>\nThe user asks"},
]


@pytest.fixture(scope="module")
def template_model(model, tmp_path_factory):
    from pathlib import Path

    src, dst = Path(model), tmp_path_factory.mktemp("kwarg-template-model")
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(
        (src / "chat_template.jinja").read_text() + KWARG_TEMPLATE
    )
    return str(dst)


@pytest.fixture(scope="module")
def tokenizer(template_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(template_model)


@pytest.fixture(scope="module")
def decode(template_model):
    from tests.workers.procs import start_worker

    # labelled as the router names the model (vLLM's --served-model-name)
    worker = start_worker(
        "decode", "--metrics-port", "0", "--served-model-name", SERVED, model=template_model
    )
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
    with _router(decode) as r:
        wait_ready(r)
        yield r


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def hf_chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    """The reference: transformers renders the template, the tokenizer encodes it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _metrics(text: str) -> dict:
    """{(sample name, sorted labels): value}"""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _worker_metrics(worker) -> dict:
    port = next(
        json.loads(line[len("PDSERVE ") :])["metrics_port"]
        for line in worker.log
        if line.startswith("PDSERVE ")
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return _metrics(r.read().decode())


# ----------------------------------------------------------------------------- endpoints


def test_tokenize_round_trips_through_detokenize(router, tokenizer):
    text = "Disaggregated serving: prefill here, decode there. ¿Qué tal? 東京"
    reply = http("POST", router.url + "/tokenize", {"model": SERVED, "prompt": text})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] is None
    back = http("POST", router.url + "/detokenize", {"model": SERVED, "tokens": body["tokens"]})
    assert back.status == 200 and back.json() == {"prompt": text}

    strs = http("POST", router.url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert strs.json()["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])

    chat = http("POST", router.url + "/tokenize", {"messages": QUESTION})
    expected = hf_chat_ids(tokenizer, QUESTION, add_generation_prompt=True)
    assert chat.json()["tokens"] == expected
    back = http("POST", router.url + "/detokenize", {"tokens": chat.json()["tokens"]})
    assert back.json()["prompt"].endswith("<|im_start|>assistant\n")

    # bad input: the router's 400s name the field, the worker's range check too
    bad = http("POST", router.url + "/tokenize", {"prompt": text, "chat_template": "x"})
    assert_openai_error(bad, 400, param="chat_template")
    bad = http("POST", router.url + "/tokenize", {"prompt": text, "echo": True})
    assert_openai_error(bad, 400, param="echo")
    bad = http("POST", router.url + "/detokenize", {"tokens": [10**6]})
    assert "token ids must be integers in [0, 49152)" in assert_openai_error(bad, 400)["message"]
    bad = http("POST", router.url + "/tokenize", {"model": "other", "prompt": "x"})
    assert_openai_error(bad, 404, param="model", code="model_not_found")


def test_version_and_retrieve_model(router, client):
    version = http("GET", router.url + "/version")
    assert version.status == 200 and version.json()["version"]
    card = client.models.retrieve(SERVED)
    assert card.id == SERVED and card.object == "model"
    assert card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ----------------------------------------------------------------------------- chat options


def test_chat_template_kwargs_reach_the_template(router, client, tokenizer):
    off = {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}
    ids = http("POST", router.url + "/tokenize", off).json()["tokens"]
    expected = hf_chat_ids(tokenizer, QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert ids == expected
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = http("POST", router.url + "/tokenize", {"messages": QUESTION}).json()["tokens"]
    assert ids[: len(plain)] == plain and len(ids) > len(plain)

    # the same kwarg reaches the template of a generation request
    resp = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=1,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert resp.usage.prompt_tokens == len(ids)

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED,
            messages=QUESTION,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )
    assert e.value.body["param"] == "chat_template_kwargs.tokenize"


def test_continue_final_message(router, client, tokenizer):
    options = {"continue_final_message": True, "add_generation_prompt": False}
    ids = http("POST", router.url + "/tokenize", {"messages": CONTINUE, **options})
    expected = hf_chat_ids(
        tokenizer, CONTINUE, add_generation_prompt=False, continue_final_message=True
    )
    assert ids.json()["tokens"] == expected
    assert tokenizer.decode(expected).endswith("<think>\nThe user asks")  # left open

    resp = client.chat.completions.create(
        model=SERVED, messages=CONTINUE, max_tokens=10, temperature=0, extra_body=options
    )
    assert resp.usage.prompt_tokens == len(expected)
    assert "</think>" in resp.choices[0].message.content  # it continued the pattern

    # vLLM's rule: the two are exclusive, and add_generation_prompt defaults to true
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED, messages=CONTINUE, extra_body={"continue_final_message": True}
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "continue_final_message"


def test_reasoning_parser_streaming_and_not(decode, client):
    options = {"continue_final_message": True, "add_generation_prompt": False}
    kw = dict(model=SERVED, messages=CONTINUE, max_tokens=10, temperature=0, extra_body=options)
    raw = client.chat.completions.create(**kw).choices[0].message.content
    want_reasoning, _, want_content = raw.partition("</think>")
    assert want_reasoning.strip() and want_content.strip(), raw

    with _router(decode, reasoning_parser="deepseek_r1") as r:
        wait_ready(r)
        rc = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        message = rc.chat.completions.create(**kw).choices[0].message
        assert message.reasoning_content == message.model_extra["reasoning"] == want_reasoning
        assert message.content == want_content

        reasoning = content = ""
        for chunk in rc.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning_content") or ""
            content += delta.content or ""
        assert (reasoning, content) == (want_reasoning, want_content)


# ----------------------------------------------------------------------------- metrics


def test_vllm_metrics_move(router, client, decode):
    label = (("model_name", SERVED),)
    before = _metrics(http("GET", router.url + "/metrics").body.decode())
    stream = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # the first token is out: the request is running on the worker
    decode.load()  # a GetLoad refreshes the worker's gauges, as the router's probes do
    during = _worker_metrics(decode)
    usage = [c.usage for c in stream if c.usage][0]
    after = _metrics(http("GET", router.url + "/metrics").body.decode())

    wlabel = label  # the worker's gauges carry the served name, as the router's metrics
    assert during[("vllm:num_requests_running", wlabel)] == 1
    assert during[("vllm:num_requests_waiting", wlabel)] == 0
    assert 0 < during[("vllm:kv_cache_usage_perc", wlabel)] < 1

    def moved(name, labels=label):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == usage.completion_tokens == 12
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 11
    assert moved("vllm:inter_token_latency_seconds_sum") > 0
    reason = (("finished_reason", "length"), ("model_name", SERVED))
    assert moved("vllm:request_success_total", reason) == 1
    # the pdserve_ names stay
    assert moved("pdserve_router_generation_tokens_total", ()) == 12
