"""Issue 16, completions and sampling, through real workers (the default SmolLM2 in fp32,
prefill chunked at 16 tokens) and the official openai client, disaggregated (1P1D) and
colocated (the same decode worker prefilling itself): prompt logprobs (echo + logprobs,
prompt_logprobs) equal transformers' log-softmax; logit_bias, bad_words,
allowed_token_ids, truncate_prompt_tokens and continuous usage stats do what they say;
and the field walk: every field of the OpenAI chat / completions request schemas and
vLLM's extra request fields is honoured or refused with a 400 naming it."""

from __future__ import annotations

import json
import logging
import typing

import openai
import pytest
import torch

from router.config import RouterConfig
from tests.engine.helpers import hf_load, hf_logprobs
from tests.router.helpers import RouterThread, http
from tests.router.walk_structured import REFUSED_VALUES as REFUSED_STRUCTURED
from tests.router.walk_structured import structured_probes

SERVED = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# 30 tokens: two prefill chunks of 16
PROMPT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
    "Berlin is the capital of Germany. The capital of Italy is"
)


@pytest.fixture(scope="module")
def pair(model):
    from tests.workers.procs import worker_pair

    args = ("--num-kv-blocks", "256", "--max-num-batched-tokens", "16")
    with worker_pair(model, prefill_args=args, decode_args=args) as workers:
        yield workers


def _router(prefill, decode):
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=prefill,
        decode=decode,
        served_model_name=SERVED,
        health_interval=0.5,
    )
    return RouterThread(cfg)


@pytest.fixture(scope="module")
def routers(pair):
    import time

    prefill, decode = pair
    with (
        _router((prefill.address,), (decode.address,)) as pd,
        _router((), (decode.address,)) as co,
    ):
        deadline = time.monotonic() + 30
        while not (pd.state.registry.usable_pairs() and co.state.registry.usable_pairs()):
            assert time.monotonic() < deadline, "routers not ready"
            time.sleep(0.05)
        yield {"pd": pd, "co": co}


@pytest.fixture(params=["pd", "co"])
def client(request, routers):
    return openai.OpenAI(base_url=routers[request.param].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return hf_load(default_model_dir)


@pytest.fixture(autouse=True)
def no_leaks(pair):
    yield
    for w in pair:
        report = w.wait_all_blocks_free(timeout=5.0)
        assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked blocks"


def check_against_hf(ids, logprobs, ref, top_n=None):
    """logprobs[j]: {token: logprob} or (logprob, rank) for prompt token j >= 1."""
    for j in range(1, len(ids)):
        row = ref[j - 1]
        got = logprobs[j]
        assert abs(got - row[ids[j]].item()) < 1e-4, (j, got, row[ids[j]].item())


# ------------------------------------------------------------------ prompt logprobs


def test_echo_logprobs_equal_transformers(client, colocated, hf):
    ids = colocated.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # chunked: two prefill steps
    ref = hf_logprobs(hf, ids)
    # twice: the second run finds the prompt in both workers' prefix caches
    for _ in range(2):
        out = client.completions.create(
            model=SERVED, prompt=PROMPT, echo=True, logprobs=2, max_tokens=2, temperature=0
        )
        lp = out.choices[0].logprobs
        assert out.choices[0].text.startswith(PROMPT)
        assert len(lp.tokens) == len(ids) + 2
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[: len(ids)]) == colocated.tokenizer.decode(ids)
        check_against_hf(ids, lp.token_logprobs[: len(ids)], ref)
        for j in range(1, len(ids)):
            top2 = torch.topk(ref[j - 1], 2).indices.tolist()
            expected = {colocated.tokenizer.decode([t]) for t in [*top2, ids[j]]}
            assert set(lp.top_logprobs[j]) == expected
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert out.usage.prompt_tokens == len(ids)


def test_prompt_logprobs_chat_and_token_prompt(client, colocated, hf):
    ids = colocated.apply_chat_template(QUESTION)
    ref = hf_logprobs(hf, ids)
    out = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    plp = out.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    check_against_hf(ids, [None] + [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])], ref)
    for j in range(1, len(ids)):
        top = int(torch.argmax(ref[j - 1]))
        assert plp[j][str(top)]["rank"] == 1
        assert plp[j][str(ids[j])]["rank"] == int((ref[j - 1] > ref[j - 1][ids[j]]).sum()) + 1
    # completions with a token-id prompt: the choice carries them
    comp = client.completions.create(
        model=SERVED, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    plp = comp.choices[0].model_extra["prompt_logprobs"]
    assert [set(e) for e in plp[1:]] == [{str(t)} for t in ids[1:]]
    check_against_hf(ids, [None] + [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])], ref)


# ------------------------------------------------------------------ sampling fields


def test_logit_bias_allowed_token_ids_and_bad_words(client, colocated):
    tok = colocated.tokenizer
    t = tok.encode(" Rome")[0]
    kw = dict(model=SERVED, messages=QUESTION, max_tokens=4, temperature=0)
    # the prefill worker samples the first token, the decode worker the rest: both biased
    forced = client.chat.completions.create(**kw, logit_bias={str(t): 100})
    assert forced.choices[0].message.content == tok.decode([t] * 4)
    allowed = [tok.encode(" yes")[0], tok.encode(" no")[0]]
    out = client.chat.completions.create(
        **kw, extra_body={"allowed_token_ids": allowed, "ignore_eos": True}
    )
    got = tok.encode(out.choices[0].message.content)
    assert out.usage.completion_tokens == 4 and set(got) <= set(allowed), got
    base = client.chat.completions.create(**kw).choices[0].message.content
    word = base.split()[0]  # "The"
    banned = client.chat.completions.create(**kw, extra_body={"bad_words": [word]})
    assert word not in banned.choices[0].message.content.split()
    # sampled (not greedy) rows take the same device path
    drawn = client.chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=4, temperature=1.0, seed=1,
        logit_bias={str(t): 100},
    )  # fmt: skip
    assert drawn.choices[0].message.content == tok.decode([t] * 4)


def test_truncate_prompt_tokens_equals_the_truncated_prompt(client, colocated):
    ids = colocated.tokenizer.encode(PROMPT)
    kw = dict(model=SERVED, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": 10}, **kw)
    short = client.completions.create(prompt=ids[-10:], **kw)
    assert cut.usage.prompt_tokens == 10
    assert cut.choices[0].text == short.choices[0].text


def test_continuous_usage_stats(routers):
    client = openai.OpenAI(base_url=routers["pd"].url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=SERVED,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 1
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


# ------------------------------------------------------------------ the field walk

# vLLM's extra request fields (vllm/entrypoints/openai/{chat_completion,completion}/
# protocol.py, plus the older guided_* names), on top of OpenAI's.
VLLM_COMMON = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "prompt_logprobs", "logprob_token_ids",
    "allowed_token_ids", "bad_words", "add_special_tokens", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs",
    "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "stream_interval", "thinking_token_budget", "logits_processors",
]  # fmt: skip
VLLM_CHAT = [
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "include_reasoning",
    "reasoning_effort", "return_prompt_text", "parallel_tool_calls", "best_of",
]  # fmt: skip
VLLM_COMPLETION = ["prompt_embeds", "echo"]
# owned by work in flight (tools, chat templates, reasoning): a 200 (honoured there) or
# a 400 naming the field. The structured-output fields have probes (walk_structured.py);
# the legacy functions / function_call must be a 400.
OTHERS = {
    "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "reasoning_effort",
    "include_reasoning", "thinking_token_budget",
}  # fmt: skip
# the fields every request carries
BASE = {"model", "messages", "prompt"}


def openai_fields(kind: str) -> set[str]:
    """The installed openai client's request schema (its TypedDicts, streaming and not)."""
    if kind == "chat":
        from openai.types.chat import completion_create_params as m
    else:
        from openai.types import completion_create_params as m
    names = set()
    for cls in (m.CompletionCreateParamsNonStreaming, m.CompletionCreateParamsStreaming):
        names |= set(typing.get_type_hints(cls))
    return names


def walk_fields(kind: str) -> list[str]:
    vllm = VLLM_COMMON + (VLLM_CHAT if kind == "chat" else VLLM_COMPLETION)
    return sorted((openai_fields(kind) | set(vllm)) - BASE)


# Requests whose effect is visible: field -> (extra body, check(reply body or SSE text,
# reference)). The reference is the same request without the field, greedy.
def _text(body, kind):
    c = body["choices"][0]
    return c["message"]["content"] if kind == "chat" else c["text"]


# prompts whose greedy continuations repeat tokens, so that every penalty shows
WALK_PROMPT = {"chat": "1, 1, 1, 1, 1, 1, 1, 1,", "completion": "yes no yes no yes no"}


def _probes(kind: str, tok, ref: dict) -> dict:
    rome = tok.encode(" Rome")[0]
    t = lambda b: _text(b, kind)  # noqa: E731
    stop = t(ref)[2:5]
    cut = t(ref).index(stop)
    word = t(ref).split()[0]
    return {
        "n": ({"n": 2}, lambda b, r: len(b["choices"]) == 2),
        "best_of": ({"n": 2, "best_of": 2}, lambda b, r: len(b["choices"]) == 2),
        "max_tokens": ({"max_tokens": 2}, lambda b, r: b["usage"]["completion_tokens"] == 2),
        "max_completion_tokens": (
            {"max_completion_tokens": 2},
            lambda b, r: b["usage"]["completion_tokens"] == 2,
        ),
        "seed": (
            {"seed": 7, "temperature": 1.0},
            lambda b, r: b["choices"][0]["logprobs"] is None,  # reproducibility: below
        ),
        "stop": (
            {"stop": [stop]},
            lambda b, r: b["choices"][0]["stop_reason"] == stop and t(b) == t(r)[:cut],
        ),
        "temperature": ({"temperature": 0}, lambda b, r: t(b) == t(r)),
        "top_p": ({"temperature": 1.0, "top_p": 1e-9}, lambda b, r: t(b) == t(r)),
        "top_k": ({"temperature": 1.0, "top_k": 1}, lambda b, r: t(b) == t(r)),
        "min_p": ({"temperature": 1.0, "min_p": 1.0}, lambda b, r: t(b) == t(r)),
        "presence_penalty": ({"presence_penalty": 2.0}, lambda b, r: t(b) != t(r)),
        "frequency_penalty": ({"frequency_penalty": 2.0}, lambda b, r: t(b) != t(r)),
        "repetition_penalty": ({"repetition_penalty": 2.0}, lambda b, r: t(b) != t(r)),
        "logit_bias": ({"logit_bias": {str(rome): 100}}, lambda b, r: t(b) == " Rome" * 8),
        "allowed_token_ids": ({"allowed_token_ids": [rome]}, lambda b, r: t(b) == " Rome" * 8),
        "bad_words": (
            {"bad_words": [word]},
            lambda b, r: t(b) != t(r) and word not in t(b).split(),
        ),
        "logprobs": (
            {"logprobs": True} if kind == "chat" else {"logprobs": 1},
            lambda b, r: b["choices"][0]["logprobs"] is not None,
        ),
        "top_logprobs": (
            {"logprobs": True, "top_logprobs": 2},
            lambda b, r: len(b["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2,
        ),
        "echo": ({"echo": True}, lambda b, r: t(b) == WALK_PROMPT[kind] + t(r)),
        "stop_token_ids": (
            {"stop_token_ids": [rome], "logit_bias": {str(rome): 100}},
            lambda b, r: b["choices"][0]["stop_reason"] == rome,
        ),
        "include_stop_str_in_output": (
            {"stop": [stop], "include_stop_str_in_output": True},
            lambda b, r: t(b) == t(r)[: cut + len(stop)],
        ),
        "ignore_eos": (
            {"ignore_eos": True, "logit_bias": {str(tok.eos_token_id): 100}},
            lambda b, r: b["usage"]["completion_tokens"] == 8,
        ),
        "min_tokens": (
            {"min_tokens": 8, "logit_bias": {str(tok.eos_token_id): 50}},
            lambda b, r: b["usage"]["completion_tokens"] == 8,
        ),
        "skip_special_tokens": (
            {
                "skip_special_tokens": False,
                "allowed_token_ids": [tok.eos_token_id],
                "ignore_eos": True,
            },
            lambda b, r: tok.eos_token in t(b),
        ),  # fmt: skip
        "truncate_prompt_tokens": (
            {"truncate_prompt_tokens": 2},
            lambda b, r: b["usage"]["prompt_tokens"] == 2,
        ),
        "prompt_logprobs": (
            {"prompt_logprobs": 0},
            lambda b, r: (
                len(b.get("prompt_logprobs") or b["choices"][0]["prompt_logprobs"])
                == b["usage"]["prompt_tokens"]
            ),
        ),
        "stream": ({"stream": True}, lambda b, r: b.startswith("data: ")),
        "stream_options": (
            {"stream": True, "stream_options": {"include_usage": True}},
            lambda b, r: '"usage":{"prompt_tokens"' in b,
        ),
        "user": ({"user": "walker-7"}, "log"),
        "safety_identifier": ({"safety_identifier": "walker-8"}, "log"),
        **structured_probes(t),
    }


# non-default values for fields refused by name (the walk's default probe is an object)
REFUSED_VALUES = {
    "store": True,
    "modalities": ["text", "audio"],
    "service_tier": "flex",
    "use_beam_search": True,
    "length_penalty": 2.0,
    "truncation_side": "right",
    "priority": 1,
    "echo": True,  # chat only: completions honour it
    "stream_interval": 2,
    "return_token_ids": True,
    "functions": [{"name": "get_time", "parameters": {"type": "object"}}],
    "function_call": {"name": "get_time"},
    **REFUSED_STRUCTURED,
}


def _post(router, kind, body):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return http("POST", router.url + path, body)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_field_walk(kind, routers, colocated, caplog):
    router = routers["co"]
    tok = colocated.tokenizer
    base = {"model": SERVED, "max_tokens": 8, "temperature": 0}
    prompt = WALK_PROMPT[kind]
    base |= (
        {"messages": [{"role": "user", "content": prompt}]}
        if kind == "chat"
        else {"prompt": prompt}
    )
    ref = _post(router, kind, base)
    assert ref.status == 200, ref.body
    ref = ref.json()
    probes = _probes(kind, tok, ref)
    fields = walk_fields(kind)
    assert {"logit_bias", "prompt_logprobs", "priority", "stream_options"} <= set(fields)
    honoured, refused, failed = [], [], []
    for name in [*fields, "not_a_real_field"]:
        if name in probes and not (kind == "chat" and name == "echo"):
            extra, check = probes[name]
            with caplog.at_level(logging.INFO):
                reply = _post(router, kind, {**base, **extra})
            if reply.status != 200:
                failed.append((name, reply.status, reply.body))
            elif check == "log":
                if f"{name}={extra[name]!r}" not in caplog.text:
                    failed.append((name, "not logged"))
            else:
                body = reply.body.decode() if extra.get("stream") else reply.json()
                if not check(body, ref):
                    failed.append((name, "no effect", body, ref))
            honoured.append(name)
            continue
        value = REFUSED_VALUES.get(name, {"probe": 1})
        reply = _post(router, kind, {**base, name: value})
        if name in OTHERS and reply.status == 200:
            honoured.append(name)  # the other work honours it
            continue
        if reply.status != 400:
            failed.append((name, reply.status, reply.body))
            continue
        err = reply.json()["error"]
        if not (err["param"] == name or name in err["message"]):
            failed.append((name, "400 not naming it", err))
        refused.append(name)
    assert not failed, "\n".join(map(str, failed))
    # the seed probe above only shows it is accepted; this shows it is used
    kw = {**base, "temperature": 1.0}
    texts = [_text(_post(router, kind, {**kw, "seed": s}).json(), kind) for s in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]
    assert "not_a_real_field" in refused and "priority" in refused
    assert {"response_format", "guided_json", "guided_choice", "structured_outputs"} <= set(
        honoured
    )
    assert kind != "chat" or {"functions", "function_call"} <= set(refused)
    print(f"{kind}: honoured {sorted(honoured)}; refused {sorted(refused)}")


def test_walk_lists_the_published_schemas():
    """The installed client's schema is the one walked: a field OpenAI adds shows up here
    and the walk then has to classify it."""
    chat, comp = openai_fields("chat"), openai_fields("completion")
    assert {"messages", "logit_bias", "top_logprobs", "stream_options", "service_tier"} <= chat
    assert {"prompt", "echo", "logprobs", "suffix", "best_of"} <= comp
    assert json.dumps(walk_fields("chat"))  # sorted, plain names
