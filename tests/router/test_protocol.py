"""Request validation: every bad input is a 400 naming its parameter; good input turns
into the right worker prompts and SamplingParams."""

from __future__ import annotations

import pytest

from router.errors import APIError
from router.protocol import parse_chat_request, parse_completion_request

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": "m", "messages": MSG, **kw}


def comp(**kw):
    return {"model": "m", "prompt": "hi", **kw}


def nest(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


CHAT_ERRORS = [
    ({"model": "m"}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content",
    ),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), None),
    (chat(model=5), "model"),
    (chat(messages=[{"role": {}, "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": "hi \ud800"}]), "messages[0].content"),
    (chat(max_completion_tokens=2**32), "max_completion_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens="5"), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_tokens=2.5), "max_tokens"),
    (chat(max_completion_tokens=-1), "max_completion_tokens"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=-2), "top_k"),
    (chat(top_k=1.5), "top_k"),
    (chat(min_p=1.5), "min_p"),
    (chat(seed="1"), "seed"),
    (chat(seed=2**63), "seed"),
    (chat(seed=2**63 - 1, n=2), "seed"),
    (chat(stop=5), "stop"),
    (chat(stop=["a", 1]), "stop"),
    (chat(stop=[""]), "stop"),
    (chat(n=0), "n"),
    (chat(n=129), "n"),
    (chat(presence_penalty=2.5), "presence_penalty"),
    (chat(frequency_penalty=-3), "frequency_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(logprobs=1), "logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(ignore_eos="yes"), "ignore_eos"),
    (chat(min_tokens=-1), "min_tokens"),
    (chat(min_tokens=5, max_tokens=4), "min_tokens"),
    (chat(user=5), "user"),
    (chat(stream="true"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=True, stream_options=[1]), "stream_options"),
    (chat(stream=True, stream_options={"include_usage": 1}), "include_usage"),
    (chat(stop_token_ids=[-1]), "stop_token_ids"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(logit_bias={"1": 101}), "logit_bias"),
    (chat(logit_bias={"a": 1}), "logit_bias"),
    (chat(logit_bias=[1]), "logit_bias"),
    (chat(bad_words=["ok", ""]), "bad_words"),
    (chat(allowed_token_ids=[]), "allowed_token_ids"),
    (chat(allowed_token_ids=[1, -1]), "allowed_token_ids"),
    (chat(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (chat(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (chat(priority=1.5), "priority"),
    (chat(priority=2**40), "priority"),
    (chat(prompt_logprobs=-1), "prompt_logprobs"),
    (chat(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (
        chat(stream=True, stream_options={"continuous_usage_stats": True}),
        "stream_options.continuous_usage_stats",
    ),
    (
        chat(stream=True, stream_options={"include_obfuscation": True}),
        "stream_options.include_obfuscation",
    ),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(temperature=float("nan")), "temperature"),
    # issue 18: values that used to be a 500 (OverflowError, TypeError)
    (chat(temperature=10**400), "temperature"),
    (chat(top_p=-(10**400)), "top_p"),
    (
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": ["f"]}},
        ),
        "tool_choice",
    ),
    # token ids as decimal digits only (int() also takes " 5", "+5", "1_0")
    (chat(logit_bias={" 5": 1}), "logit_bias"),
    (chat(logit_bias={"+5": 1}), "logit_bias"),
    (chat(logit_bias={"1_0": 1}), "logit_bias"),
    (chat(logit_bias={"9" * 5000: 1}), "logit_bias"),
    # OpenAI's deprecated function calling: refused, pointing at tools / tool_choice
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(function_call="auto"), "function_call"),
    (chat(function_call={"name": "f"}), "function_call"),
    (
        chat(
            messages=[*MSG, {"role": "assistant", "content": None, "function_call": {"name": "f"}}]
        ),
        "messages[1].function_call",
    ),
    # the default limits (router/bounds.py)
    (chat(stop=["s"] * 65), "stop"),
    (chat(stop=["s" * 1025]), "stop[0]"),
    (chat(stop_token_ids=[1] * 65), "stop_token_ids"),
    (chat(messages=MSG * 4097), "messages"),
    (chat(messages=[{"role": "user", "content": "c" * 1_048_577}]), "messages[0].content"),
    (chat(bad_words=["b"] * 257), "bad_words"),
    (chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (
        chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
        "tools",
    ),
    (chat(user="u" * 1025), "user"),
    (chat(chat_template_kwargs={"a": nest(70)}), "chat_template_kwargs"),
    (chat(guided_regex="r" * (256 * 1024 + 1)), "guided_regex"),
]

COMPLETION_ERRORS = [
    ({"model": "m"}, "prompt"),
    (comp(prompt=None), "prompt"),
    (comp(prompt=""), "prompt"),
    (comp(prompt=[]), "prompt"),
    (comp(prompt=5), "prompt"),
    (comp(prompt=[1, "a"]), "prompt"),
    (comp(prompt=[[1, 2], "a"]), "prompt"),
    (comp(prompt=[[]]), "prompt"),
    (comp(prompt=[1, -2]), "prompt"),
    (comp(prompt=[1, 2**32]), "prompt"),
    (comp(prompt=[[1, True]]), "prompt"),
    (comp(echo="no"), "echo"),
    (comp(logprobs=True), "logprobs"),
    (comp(logprobs=21), "logprobs"),
    (comp(echo=True, logprobs=1, prompt_logprobs=21), "prompt_logprobs"),
    (comp(suffix="x"), "suffix"),
    (comp(best_of=3), "best_of"),
    (comp(max_tokens=0), "max_tokens"),
    # values the worker request cannot hold (they used to hang the request)
    (comp(max_tokens=5_000_000_000), "max_tokens"),
    (comp(max_tokens=10**12), "max_tokens"),
    (comp(min_tokens=5_000_000_000), "min_tokens"),
    (comp(top_k=3_000_000_000), "top_k"),
    (comp(prompt="hi \ud800"), "prompt"),
    (comp(prompt=["ok", "hi \ud800"]), "prompt[1]"),
    (comp(stop=["\udfff"]), "stop[0]"),
    (comp(prompt=["p"] * 257), "prompt"),
    (comp(prompt=[[1]] * 257), "prompt"),
    (comp(prompt="p" * (2 * 1024 * 1024 + 1)), "prompt"),
    (comp(prompt=["p"] * 9, n=128), "n"),  # 1152 choices > 1024
]


@pytest.mark.parametrize("body,param", CHAT_ERRORS)
def test_chat_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_chat_request(body)
    assert e.value.status == 400
    err = e.value.body()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err["message"]


@pytest.mark.parametrize("body,param", COMPLETION_ERRORS)
def test_completion_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_completion_request(body)
    assert e.value.status == 400
    assert e.value.body()["error"]["param"] == param, e.value.message


@pytest.mark.parametrize("body", [None, [], "x", 1])
def test_body_must_be_an_object(body):
    for parse in (parse_chat_request, parse_completion_request):
        with pytest.raises(APIError) as e:
            parse(body)
        assert e.value.status == 400


def test_chat_conversion():
    req = parse_chat_request(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "next"},
            ],
            max_tokens=7,
            max_completion_tokens=9,
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            min_p=0.1,
            seed=42,
            n=3,
            stop="END",
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logprobs=True,
            top_logprobs=3,
            ignore_eos=True,
            min_tokens=2,
            user="u1",
            stream=True,
            stream_options={"include_usage": True},
            stop_token_ids=[5],
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )
    )
    assert req.kind == "chat" and req.model == "m" and req.n == 3 and req.num_choices == 3
    assert req.stream and req.include_usage and req.user == "u1"
    [prompt] = req.prompts
    assert prompt.messages == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", "ok"),
        ("user", "next"),
    ]
    fields = prompt.to_pb_fields()
    assert [m.role for m in fields["chat"].messages] == ["system", "user", "assistant", "user"]
    sp = req.sampling_params(2)
    assert sp.max_tokens == 9  # max_completion_tokens wins
    assert sp.seed == 44  # seed + choice
    assert sp.logprobs == 3
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.top_k == 0 and sp.min_p == pytest.approx(0.1)
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [5]
    assert sp.ignore_eos and sp.min_tokens == 2 and sp.include_stop_str_in_output
    assert sp.HasField("skip_special_tokens") and not sp.skip_special_tokens
    assert sp.repetition_penalty == pytest.approx(1.1)
    assert sp.presence_penalty == pytest.approx(0.5) and sp.frequency_penalty == pytest.approx(-0.5)


def test_chat_defaults_leave_worker_defaults():
    req = parse_chat_request(chat())
    sp = req.sampling_params(0)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "min_p"):
        assert not sp.HasField(name), name  # unset: the worker's default (max_tokens: context)
    assert req.n == 1 and not req.stream and req.logprobs is None
    # logprobs without top_logprobs: only the chosen token's
    assert parse_chat_request(chat(logprobs=True)).sampling_params(0).logprobs == 0
    # nulls are the same as absent
    assert parse_chat_request(chat(max_tokens=None, temperature=None, stop=None)).max_tokens is None


def test_completion_prompt_forms():
    assert [p.text for p in parse_completion_request(comp(prompt="a")).prompts] == ["a"]
    req = parse_completion_request(comp(prompt=["a", "b"], n=2, seed=3))
    assert [p.text for p in req.prompts] == ["a", "b"] and req.num_choices == 4
    assert [req.sampling_params(i).seed for i in range(4)] == [3, 4, 3, 4]
    ids = parse_completion_request(comp(prompt=[1, 2, 3])).prompts
    assert len(ids) == 1 and ids[0].token_ids == [1, 2, 3]
    lists = parse_completion_request(comp(prompt=[[1], [2, 3]])).prompts
    assert [p.token_ids for p in lists] == [[1], [2, 3]]
    assert lists[0].to_pb_fields()["token_ids"].ids == [1]


def test_completion_max_tokens_default_is_16():
    assert parse_completion_request(comp()).sampling_params(0).max_tokens == 16
    assert parse_completion_request(comp(max_tokens=3)).max_tokens == 3
    assert parse_completion_request(comp(max_tokens=None)).max_tokens is None  # until context


def test_completion_echo_and_logprobs():
    req = parse_completion_request(comp(echo=True))
    assert req.echo and req.logprobs is None
    assert parse_completion_request(comp(logprobs=0)).logprobs == 0
    assert parse_completion_request(comp(logprobs=5)).sampling_params(0).logprobs == 5
    # echo + logprobs asks the workers for the prompt's logprobs with the same top-n
    pb = parse_completion_request(comp(echo=True, logprobs=2)).sampling_params(0)
    assert pb.prompt_logprobs == 2 and pb.logprobs == 2
    pb = parse_completion_request(comp(echo=True, logprobs=1, prompt_logprobs=3)).sampling_params(0)
    assert pb.prompt_logprobs == 3
    assert (
        not parse_completion_request(comp(logprobs=1))
        .sampling_params(0)
        .HasField("prompt_logprobs")
    )


def test_sampling_fields_reach_the_worker_request():
    req = parse_chat_request(
        chat(
            logit_bias={"7": -100, "9": 2.5},
            bad_words=["foo bar"],
            allowed_token_ids=[3, 4],
            truncate_prompt_tokens=-1,
            prompt_logprobs=0,
            priority=0,
        )
    )
    pb = req.sampling_params(0)
    assert dict(pb.logit_bias) == {7: -100.0, 9: 2.5}
    assert list(pb.bad_words) == ["foo bar"] and list(pb.allowed_token_ids.ids) == [3, 4]
    assert pb.truncate_prompt_tokens == -1 and pb.prompt_logprobs == 0
    plain = parse_chat_request(chat()).sampling_params(0)
    assert not plain.HasField("allowed_token_ids") and not plain.HasField("truncate_prompt_tokens")
    # token-id prompts are truncated in the router already (its context check counts them)
    cut = parse_completion_request(comp(prompt=[1, 2, 3, 4], truncate_prompt_tokens=2))
    assert cut.prompts[0].token_ids == [3, 4]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_chat_request(chat(stream=True, stream_options=opts)).continuous_usage


def test_prefix_key_shares_leading_part():
    long = "x" * 1000
    a = parse_chat_request(chat(messages=[{"role": "system", "content": long}, *MSG]))
    b = parse_chat_request(
        chat(messages=[{"role": "system", "content": long}, {"role": "user", "content": "b"}])
    )
    assert a.prompts[0].prefix_key() == b.prompts[0].prefix_key()
    ids = parse_completion_request(comp(prompt=list(range(100)))).prompts[0]
    ids2 = parse_completion_request(comp(prompt=[*range(64), 7, 7])).prompts[0]
    assert ids.prefix_key() == ids2.prefix_key()


# ----------------------------------------------------------------------------- chat options


def _param_of(parse, body) -> str:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value.param


def test_chat_options_travel_in_the_conversation():
    import json

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    req = parse_chat_request(
        {
            "messages": msgs,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False, "depth": {"n": 3}},
        }
    )
    conv = req.prompts[0].to_pb_fields()["chat"]
    assert conv.add_generation_prompt is False and conv.continue_final_message is True
    assert json.loads(conv.chat_template_kwargs_json) == {
        "enable_thinking": False,
        "depth": {"n": 3},
    }
    # defaults: generation prompt on (sent explicitly), no kwargs
    conv = parse_chat_request({"messages": msgs}).prompts[0].to_pb_fields()["chat"]
    assert conv.HasField("add_generation_prompt") and conv.add_generation_prompt
    assert not conv.continue_final_message and conv.chat_template_kwargs_json == ""


def test_chat_options_refused_with_the_field_named():
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        _param_of(parse_chat_request, {"messages": msgs, "continue_final_message": True})
        == "continue_final_message"
    )
    assert (
        _param_of(parse_chat_request, {"messages": msgs, "chat_template_kwargs": [1]})
        == "chat_template_kwargs"
    )
    body = {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert _param_of(parse_chat_request, body) == "chat_template_kwargs.add_generation_prompt"
    body = {"messages": msgs, "add_generation_prompt": "no"}
    assert _param_of(parse_chat_request, body) == "add_generation_prompt"


def test_tokenize_and_detokenize_bodies():
    from router.protocol import parse_detokenize_request, parse_tokenize_request

    text = parse_tokenize_request({"model": "m", "prompt": "hi"})
    assert text.prompt.text == "hi" and text.add_special_tokens and not text.return_token_strs
    chat = parse_tokenize_request({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.prompt.messages == [("user", "hi")] and not chat.add_special_tokens
    assert _param_of(parse_tokenize_request, {"prompt": 3}) == "prompt"
    assert _param_of(parse_tokenize_request, {"prompt": "a", "messages_": []}) == "messages_"
    assert _param_of(parse_tokenize_request, {"prompt": "a", "tools": [{}]}) == "tools"
    # a chat-only field with a text prompt is not silently dropped
    body = {"prompt": "a", "chat_template_kwargs": {"x": 1}}
    assert _param_of(parse_tokenize_request, body) == "chat_template_kwargs"
    assert parse_detokenize_request({"tokens": [1, 2]}) == (None, [1, 2])
    assert parse_detokenize_request({"tokens": []}) == (None, [])
    assert _param_of(parse_detokenize_request, {"tokens": [-1]}) == "tokens"
    assert _param_of(parse_detokenize_request, {"tokens": "12"}) == "tokens"


def test_router_and_worker_reserve_the_same_template_kwargs():
    """The router refuses these chat_template_kwargs early (a 400 naming the key); the
    worker, which renders the template, refuses the same set (the router image does not
    ship the worker's code, so each holds its copy)."""
    from router.protocol import RESERVED_TEMPLATE_KWARGS as router_side
    from services.models.tokenizer import RESERVED_TEMPLATE_KWARGS as worker_side

    assert router_side == worker_side


def test_limits_are_per_request_settings():
    from router.bounds import RequestLimits

    tight = RequestLimits(max_stop_sequences=1, max_messages=1)
    assert parse_chat_request(chat(stop=["a", "b"])).sampling["stop"] == ["a", "b"]
    for body, param in ((chat(stop=["a", "b"]), "stop"), (chat(messages=MSG * 2), "messages")):
        with pytest.raises(APIError) as e:
            parse_chat_request(body, tight)
        assert e.value.param == param and e.value.code == "array_above_max_length"
        assert "maximum length 1" in e.value.message


def test_null_skip_special_tokens_is_the_worker_default():
    assert "skip_special_tokens" not in parse_chat_request(chat(skip_special_tokens=None)).sampling
    assert (
        parse_chat_request(chat(skip_special_tokens=False)).sampling["skip_special_tokens"] is False
    )


def test_no_op_legacy_function_fields_are_accepted():
    for extra in ({"functions": []}, {"functions": None}, {"function_call": "none"}):
        assert parse_chat_request(chat(**extra)).prompts
