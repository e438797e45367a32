"""Parsing and validation of /v1/chat/completions, /v1/completions, /tokenize and
/detokenize bodies.

The result is a GenerationRequest: the prompts to send to workers (text, token ids or a
conversation; the worker tokenizes and applies the chat template) and the sampling
settings, with OpenAI's semantics and vLLM's extensions. Every problem raises
APIError(400) naming the offending parameter; every list and string is bounded
(router/bounds.py, the router's request limits).

The parts: router/fields.py reads single fields, router/catalog.py lists the fields
(honoured, refused, their types and bounds), router/prompts.py parses conversations and
completion prompts; this module puts a request together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdpb.v1 import common_pb2
from router import structured
from router.bounds import DEFAULT_LIMITS, RequestLimits
from router.catalog import (
    DETOKENIZE_FIELDS,
    HONOURED_FIELDS,
    MAX_LOGPROBS,
    MAX_N,
    TOKENIZE_CHAT_FIELDS,
    TOKENIZE_SCALARS,
    TOKENIZE_TEXT_FIELDS,
    check_fields,
    only_fields,
    read,
)
from router.errors import bad_request
from router.fields import (
    MAX_INT32,
    MAX_SEED,
    MAX_TOKEN_ID,
    MAX_UINT32,
    MISSING,
    check_body,
    check_items,
    get,
    get_bool,
    str_list,
    token_list,
)
from router.prompts import (
    CHAT_ROLES,
    RESERVED_TEMPLATE_KWARGS,
    Prompt,
    chat_prompt,
    check_prompt_bytes,
    completion_prompts,
)
from router.tools import forced_constraint, parse_tool_choice

# the names other modules and tests import from here
__all__ = [
    "CHAT_ROLES",
    "HONOURED_FIELDS",
    "MAX_INT32",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_SEED",
    "MAX_TOKEN_ID",
    "MAX_UINT32",
    "RESERVED_TEMPLATE_KWARGS",
    "GenerationRequest",
    "Prompt",
    "RequestLimits",
    "TokenizeRequest",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_tokenize_request",
]


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    prompts: list[Prompt]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top-n per prompt token)
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    max_tokens: int | None = None  # None: until the context is full
    seed: int | None = None
    # OpenAI's end-user ids (abuse monitoring): logged with the request
    user: str | None = None
    safety_identifier: str | None = None
    structured_param: str | None = None  # the field the structured output came from
    sampling: dict = field(default_factory=dict)  # SamplingParams fields except seed/max
    tool_choice: str = "none"  # "auto": the router's tool parser reads the output
    tool_choice_name: str | None = None  # tool_choice "named": the function
    parallel_tool_calls: bool = True

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def sampling_params(self, choice: int) -> common_pb2.SamplingParams:
        """The worker's SamplingParams for choice `choice` (seed + i within a prompt)."""
        pb = common_pb2.SamplingParams(**self.sampling)
        if self.max_tokens is not None:
            pb.max_tokens = self.max_tokens
        if self.seed is not None:
            pb.seed = self.seed + choice % self.n
        if self.logprobs is not None:
            pb.logprobs = self.logprobs
        # echo + logprobs reports the prompt tokens' logprobs with the same top-n
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        wanted = [n for n in wanted if n is not None]
        if wanted:
            pb.prompt_logprobs = max(wanted)
        return pb


# ----------------------------------------------------------------------- generation


def parse_chat_request(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> GenerationRequest:
    fields, sampling = _common(body, "chat", limits)
    _check_tool_choice_shape(body)
    prompt = chat_prompt(body, limits)

    want_logprobs = read(body, "chat", "logprobs")
    top = read(body, "chat", "top_logprobs")
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    tool_choice, tool_name, parallel = parse_tool_choice(body, prompt.tools)
    if tool_choice in ("required", "named"):
        if "structured_output" in sampling:
            raise bad_request(
                f"tool_choice {tool_choice!r} constrains the output itself: it cannot be "
                f"combined with {fields['structured_param']}",
                "tool_choice",
            )
        sampling["structured_output"] = forced_constraint(
            prompt.tools, tool_choice, tool_name, parallel
        )
        fields["structured_param"] = "tool_choice"
    _check_constraint(sampling, fields["structured_param"], limits)
    _check_choices(1, fields["n"], limits)
    return GenerationRequest(
        prompts=[prompt],
        logprobs=logprobs,
        sampling=sampling,
        tool_choice=tool_choice,
        tool_choice_name=tool_name,
        parallel_tool_calls=parallel,
        **fields,
    )


def parse_completion_request(
    body: Any, limits: RequestLimits = DEFAULT_LIMITS
) -> GenerationRequest:
    fields, sampling = _common(body, "completion", limits)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompts = completion_prompts(body["prompt"], limits)
    _check_constraint(sampling, fields["structured_param"], limits)
    _check_choices(len(prompts), fields["n"], limits)
    echo = read(body, "completion", "echo")
    logprobs = read(body, "completion", "logprobs")
    keep = sampling.get("truncate_prompt_tokens")
    if keep is not None and keep > 0:
        # token-id prompts are cut here already, so the router's context check sees them
        # as the worker will
        for p in prompts:
            if p.token_ids is not None:
                p.token_ids = p.token_ids[-keep:]
    return GenerationRequest(
        prompts=prompts, echo=echo, logprobs=logprobs, sampling=sampling, **fields
    )


def _check_choices(prompts: int, n: int, limits: RequestLimits) -> None:
    if prompts * n > limits.max_choices:
        raise bad_request(
            f"Invalid 'n': {prompts} prompt(s) x n={n} is {prompts * n} choices, over the "
            f"limit of {limits.max_choices} per request",
            "n",
            code="too_many_choices",
        )


def _check_constraint(sampling: dict, param: str | None, limits: RequestLimits) -> None:
    so = sampling.get("structured_output")
    if so is not None and len(so.spec.encode("utf-8")) > limits.max_constraint_bytes:
        raise bad_request(
            f"Invalid '{param}': the structured output constraint is "
            f"{len(so.spec.encode('utf-8'))} bytes, over the limit of "
            f"{limits.max_constraint_bytes} bytes (the router's --max-constraint-bytes)",
            param,
            code="constraint_above_max_bytes",
        )


def _check_tool_choice_shape(body: dict) -> None:
    """A named tool_choice's name must be a string before router/tools.py looks it up."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", "tool_choice")


def _common(body: Any, kind: str, limits: RequestLimits) -> tuple[dict, dict]:
    """Shared fields of both endpoints -> (GenerationRequest kwargs, sampling dict)."""
    check_body(body, limits.max_json_depth)
    check_fields(body, kind)
    if kind == "chat" and read(body, kind, "echo"):
        raise bad_request("echo is not supported for chat completions", "echo")
    constraint, structured_param = structured.parse(body)

    model = read(body, kind, "model")
    n = read(body, kind, "n")
    best_of = read(body, kind, "best_of")
    if best_of is not None and best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")

    stream = read(body, kind, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)

    max_tokens = read(body, kind, "max_tokens")
    max_completion = read(body, kind, "max_completion_tokens") if kind == "chat" else None
    if max_completion is not None:
        max_tokens = max_completion
    elif kind == "completion" and "max_tokens" not in body:
        max_tokens = 16  # OpenAI's default for /v1/completions

    seed = read(body, kind, "seed")
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise bad_request("'seed' + n - 1 must fit in a signed 64-bit integer", "seed")

    min_tokens = read(body, kind, "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    top_k = read(body, kind, "top_k")
    stop_token_ids = get(body, "stop_token_ids", [])
    if not isinstance(stop_token_ids, list):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if stop_token_ids:
        stop_token_ids = token_list(stop_token_ids, "stop_token_ids", limits.max_stop_sequences)
    stop = get(body, "stop", MISSING)
    stop = (
        []
        if stop is MISSING
        else str_list(stop, "stop", limits.max_stop_sequences, limits.max_stop_chars)
    )

    sampling: dict = {
        "presence_penalty": read(body, kind, "presence_penalty"),
        "frequency_penalty": read(body, kind, "frequency_penalty"),
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": read(body, kind, "ignore_eos"),
        "min_tokens": min_tokens,
        "include_stop_str_in_output": read(body, kind, "include_stop_str_in_output"),
    }
    optional = {
        "temperature": read(body, kind, "temperature"),
        "top_p": read(body, kind, "top_p"),
        "top_k": None if top_k is None else max(top_k, 0),
        "min_p": read(body, kind, "min_p"),
        "repetition_penalty": read(body, kind, "repetition_penalty"),
        # absent (or null): the worker's default
        "skip_special_tokens": get_bool(body, "skip_special_tokens", default=None),
    }
    sampling.update({k: v for k, v in optional.items() if v is not None})
    sampling.update(_logits_shaping(body, kind, limits))
    if constraint is not None:
        sampling["structured_output"] = constraint
    priority = read(body, kind, "priority")
    if priority:  # the workers' --scheduling-policy decides (fcfs refuses it, as vLLM)
        sampling["priority"] = priority
    prompt_logprobs = read(body, kind, "prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    fields = dict(
        kind=kind,
        model=model,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        prompt_logprobs=prompt_logprobs,
        max_tokens=max_tokens,
        seed=seed,
        user=read(body, kind, "user"),
        safety_identifier=read(body, kind, "safety_identifier"),
        structured_param=structured_param,
    )
    return fields, sampling


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)"""
    opts = get(body, "stream_options", MISSING)
    if opts is MISSING:
        return False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = get_bool(opts, "include_usage")
    continuous_usage = get_bool(opts, "continuous_usage_stats")
    if continuous_usage and not include_usage:
        raise bad_request(
            "stream_options.continuous_usage_stats requires include_usage",
            "stream_options.continuous_usage_stats",
        )
    for key in opts:
        if key not in ("include_usage", "continuous_usage_stats") and opts[key] not in (
            None,
            False,
        ):
            raise bad_request(f"stream_options.{key} is not supported", f"stream_options.{key}")
    return include_usage, continuous_usage


def _logits_shaping(body: dict, kind: str, limits: RequestLimits) -> dict:
    """logit_bias (OpenAI), bad_words, allowed_token_ids and truncate_prompt_tokens
    (vLLM) as SamplingParams fields; token ids are checked against the vocabulary by
    the worker."""
    out: dict = {}
    bias = get(body, "logit_bias", MISSING)
    if bias is not MISSING:
        if not isinstance(bias, dict):
            raise bad_request("'logit_bias' must be an object of token id -> bias", "logit_bias")
        check_items(bias, "logit_bias", limits.max_logit_bias)
        table = {}
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()):  # int() would take " 5", "+5", "1_0"
                raise bad_request(f"'logit_bias' key {k[:32]!r} is not a token id", "logit_bias")
            tid = int(k) if len(k) <= 20 else MAX_TOKEN_ID + 1
            if not 0 <= tid <= MAX_TOKEN_ID:
                raise bad_request(
                    f"'logit_bias' has an out-of-range token id {k[:32]}", "logit_bias"
                )
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise bad_request(
                    f"'logit_bias' values must be numbers in [-100, 100], got {v!r:.32} for "
                    f"{k[:32]}",
                    "logit_bias",
                )
            table[tid] = float(v)
        if table:
            out["logit_bias"] = table
    words = get(body, "bad_words", [])
    if words:
        words = str_list(
            words,
            "bad_words",
            limits.max_bad_words,
            limits.max_stop_chars,
            single=False,
            strip=True,
        )
        out["bad_words"] = words
    elif not isinstance(words, list):
        raise bad_request("'bad_words' must be a list of non-empty strings", "bad_words")
    allowed = get(body, "allowed_token_ids", MISSING)
    if allowed is not MISSING:
        if not isinstance(allowed, list):
            raise bad_request(
                "'allowed_token_ids' must be a list of token ids", "allowed_token_ids"
            )
        out["allowed_token_ids"] = common_pb2.TokenIds(
            ids=token_list(allowed, "allowed_token_ids", limits.max_token_ids)
        )
    keep = read(body, kind, "truncate_prompt_tokens")
    if keep is not None:
        out["truncate_prompt_tokens"] = keep
    return out


# --------------------------------------------------------------------------- /tokenize


@dataclass
class TokenizeRequest:
    """vLLM's /tokenize body: a completion prompt (text) or a chat conversation."""

    model: str | None
    prompt: Prompt
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize_request(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> TokenizeRequest:
    check_body(body, limits.max_json_depth)
    if "messages" in body:
        only_fields(body, TOKENIZE_CHAT_FIELDS)
        prompt = chat_prompt(body, limits)
        special_default = False  # the chat template writes the special tokens
    else:
        only_fields(body, TOKENIZE_TEXT_FIELDS)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        prompt = Prompt(text=text)
        check_prompt_bytes([prompt], "prompt", limits)
        special_default = True
    return TokenizeRequest(
        model=TOKENIZE_SCALARS["model"].read(body, "model"),
        prompt=prompt,
        add_special_tokens=get_bool(body, "add_special_tokens", default=special_default),
        return_token_strs=TOKENIZE_SCALARS["return_token_strs"].read(body, "return_token_strs"),
    )


def parse_detokenize_request(
    body: Any, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize body -> (model, token ids)."""
    check_body(body, limits.max_json_depth)
    only_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    ids = token_list(tokens, "tokens", limits.max_token_ids) if tokens else []
    return TOKENIZE_SCALARS["model"].read(body, "model"), ids
