"""Parsing and validation of /v1/chat/completions and /v1/completions bodies.

The result is a GenerationRequest: the prompts to send to workers (text, token ids or a
conversation; the worker tokenizes and applies the chat template) and the sampling
settings, with OpenAI's semantics and vLLM's extensions. Every problem raises
APIError(400) naming the offending parameter."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdpb.v1 import common_pb2
from router import structured
from router.errors import bad_request
from router.tools import forced_constraint, message_tool_fields, parse_tool_choice, parse_tools

MAX_N = 128
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**32 - 1
MAX_UINT32 = 2**32 - 1  # max_tokens, min_tokens travel as uint32
MAX_INT32 = 2**31 - 1  # top_k travels as int32
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MISSING = object()

# Parameters we do not implement: a non-default value is an error rather than silence.
_UNSUPPORTED = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "suffix": "suffix is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "metadata": "stored completions (store, metadata) are not supported",
    "store": "stored completions (store, metadata) are not supported",
    "service_tier": "service tiers are not supported",
    "moderation": "moderation is not supported",
    "web_search_options": "web search is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported (prefix caching is automatic)",
    "prompt_cache_options": "prompt cache options are not supported (prefix caching is automatic)",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "include_reasoning": "include_reasoning is not supported",
    "thinking_token_budget": "thinking_token_budget is not supported",
    # vLLM's extensions
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "watermarking": "watermarking is not supported",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported",
    "truncation_side": "only truncation_side 'left' (keep the last tokens) is supported",
    "logprob_token_ids": "logprob_token_ids is not supported",
    "add_special_tokens": "add_special_tokens is not supported",
    "documents": "documents (RAG chat templates) are not supported",
    "chat_template": "a per-request chat_template is not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "prompt_embeds": "prompt_embeds are not supported",
    "structural_tag": "structured outputs (structural_tag) are not supported",
    "guided_decoding_backend": "only the xgrammar structured output backend is available",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "logits_processors": "custom logits processors are not supported",
    "request_id": "request_id in the body is not supported: send the X-Request-Id header",
    "session_id": "session_id is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "return_prompt_text": "return_prompt_text is not supported",
    "return_token_offsets": "return_token_offsets is not supported",
    "return_mm_kwargs": "multimodal inputs are not supported",
    "routed_experts_prompt_start": "routed expert data is not supported",
    "cache_salt": "cache_salt is not supported",
    "kv_transfer_params": "kv_transfer_params are not supported (the router pairs workers itself)",
    "ec_transfer_params": "ec_transfer_params are not supported",
    "vllm_xargs": "vllm_xargs are not supported",
    "repetition_detection": "repetition_detection is not supported",
    "stream_interval": "stream_interval is not supported",
}
# Values of unsupported parameters that ask for nothing (their defaults), besides None
# and empty values: sending them is fine.
_NO_OP = {
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "include_reasoning": (True,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "watermarking": (False,),
    "spaces_between_special_tokens": (True,),
    "truncation_side": ("left",),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_prompt_text": (False,),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True,),
    "routed_experts_prompt_start": (0,),
    "guided_decoding_backend": ("auto", "xgrammar"),
}
# add_special_tokens: chat's default is false (the template adds them), completions'
# true (the tokenizer's encode adds them), which is what the workers do
_NO_OP_BY_KIND = {("chat", "add_special_tokens"): False, ("completion", "add_special_tokens"): True}

# Every parameter each endpoint honours; with the ones above, what it knows. Anything
# else is refused by name (OpenAI does the same), so no field is silently ignored.
_HONOURED_COMMON = {
    "model", "n", "best_of", "stream", "stream_options", "max_tokens", "seed", "stop",
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "user", "safety_identifier", "response_format", "top_k", "min_p", "repetition_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "priority", *structured.FIELDS,
}  # fmt: skip
HONOURED_FIELDS = {
    "chat": _HONOURED_COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",  # router/tools.py
        "tool_choice",
        "parallel_tool_calls",
    },  # fmt: skip
    "completion": _HONOURED_COMMON | {"prompt", "echo"},
}


def _is_no_op(kind: str, name: str, v: Any) -> bool:
    if v is None or (isinstance(v, (list, dict, str)) and not v):
        return True
    allowed = [
        *_NO_OP.get(name, ()),
        *([_NO_OP_BY_KIND[kind, name]] if (kind, name) in _NO_OP_BY_KIND else []),
    ]
    return any(type(v) is type(a) and v == a for a in allowed)


def _check_fields(body: dict, kind: str) -> None:
    for name, v in body.items():
        if name in _UNSUPPORTED:
            if not _is_no_op(kind, name, v):
                raise bad_request(_UNSUPPORTED[name], name)
        elif name not in HONOURED_FIELDS[kind]:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)


@dataclass
class Prompt:
    """One worker prompt: exactly one of text, token_ids, messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[tuple[str, str]] | None = None
    # chat options (vLLM's), with messages only
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # tool calling: the tools for the template, each message's tool fields (or None)
    tools: list[dict] | None = None
    message_tools: list[dict | None] | None = None

    def prefix_key(self, chars: int = 256, tokens: int = 64) -> str:
        """The prompt's leading part: the key of the prefix_aware policy."""
        if self.token_ids is not None:
            return "ids:" + ",".join(map(str, self.token_ids[:tokens]))
        if self.messages is not None:
            return "chat:" + "\0".join(f"{r}\0{c}" for r, c in self.messages)[:chars]
        return "text:" + (self.text or "")[:chars]

    def to_pb_fields(self) -> dict:
        if self.token_ids is not None:
            return {"token_ids": common_pb2.TokenIds(ids=self.token_ids)}
        if self.messages is not None:
            return {"chat": self.conversation_pb()}
        return {"text": self.text}

    def conversation_pb(self) -> common_pb2.Conversation:
        return common_pb2.Conversation(
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs_json=(
                json.dumps(self.chat_template_kwargs) if self.chat_template_kwargs else ""
            ),
            tools_json=json.dumps(self.tools) if self.tools else "",
            message_tools_json=[json.dumps(t) if t else "" for t in self.message_tools or ()],
        )


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


# --------------------------------------------------------------------------- field readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    return default if v is _MISSING or v is None else v


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        v = int(v)
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _float(body: dict, name: str, lo=None, hi=None, lo_open=False, default=None):
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", name)
    v = float(v)
    if not math.isfinite(v):
        raise bad_request(f"'{name}' must be finite", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_request(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _str(body: dict, name: str) -> str | None:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = _get(body, "stop", _MISSING)
    if v is _MISSING:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(not s for s in v):
        raise bad_request("'stop' strings must be non-empty", "stop")
    return v


def _token_list(v: Any, name: str) -> list[int]:
    if not v:
        raise bad_request(f"'{name}' must not be empty", name)
    for t in v:
        if not _is_int(t):
            raise bad_request(f"'{name}' token ids must be integers", name)
        if not 0 <= t <= MAX_TOKEN_ID:
            raise bad_request(f"'{name}' has an out-of-range token id {t}", name)
    return list(v)


# --------------------------------------------------------------------------- requests


def _check_unicode(body: dict) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 string (and
    no protobuf string field) can hold: refuse it, naming where it is. The whole body
    is checked in one C-speed pass; only a bad one is walked to find the place."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        _find_surrogate(body, "")


def _find_surrogate(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            where = path or "the request body"
            raise bad_request(
                f"'{where}' contains a lone UTF-16 surrogate: not valid Unicode", path or None
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _find_surrogate(k, path)
            _find_surrogate(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _find_surrogate(v, f"{path}[{i}]")


def _common(body: Any, kind: str) -> tuple[dict, dict]:
    """Shared fields of both endpoints -> (GenerationRequest kwargs, sampling dict)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_unicode(body)
    _check_fields(body, kind)
    if kind == "chat" and _bool(body, "echo"):
        raise bad_request("echo is not supported for chat completions", "echo")
    constraint, structured_param = structured.parse(body)

    model = _str(body, "model")
    n = _int(body, "n", 1, MAX_N, default=1)
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")

    stream = _bool(body, "stream")
    include_usage = continuous_usage = False
    opts = _get(body, "stream_options", _MISSING)
    if opts is not _MISSING:
        if not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage")
        continuous_usage = _bool(opts, "continuous_usage_stats")
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

    max_tokens = _int(body, "max_tokens", 1, MAX_UINT32)
    max_completion = _int(body, "max_completion_tokens", 1, MAX_UINT32)
    if max_completion is not None:
        max_tokens = max_completion
    elif kind == "completion" and "max_tokens" not in body:
        max_tokens = 16  # OpenAI's default for /v1/completions

    seed = _int(body, "seed", -(2**63), MAX_SEED)
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise bad_request("'seed' + n - 1 must fit in a signed 64-bit integer", "seed")

    min_tokens = _int(body, "min_tokens", 0, MAX_UINT32, default=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    top_k = _int(body, "top_k", -1, MAX_INT32)
    stop_token_ids = _get(body, "stop_token_ids", [])
    if not isinstance(stop_token_ids, list):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if stop_token_ids:
        stop_token_ids = _token_list(stop_token_ids, "stop_token_ids")

    sampling: dict = {
        "presence_penalty": _float(body, "presence_penalty", -2.0, 2.0, default=0.0),
        "frequency_penalty": _float(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        "stop": _stop(body),
        "stop_token_ids": stop_token_ids,
        "ignore_eos": _bool(body, "ignore_eos"),
        "min_tokens": min_tokens,
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output"),
    }
    optional = {
        "temperature": _float(body, "temperature", 0.0, 2.0),
        "top_p": _float(body, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": None if top_k is None else max(top_k, 0),
        "min_p": _float(body, "min_p", 0.0, 1.0),
        "repetition_penalty": _float(body, "repetition_penalty", 0.0, 2.0, lo_open=True),
        "skip_special_tokens": (
            _bool(body, "skip_special_tokens") if "skip_special_tokens" in body else None
        ),
    }
    sampling.update({k: v for k, v in optional.items() if v is not None})
    sampling.update(_logits_shaping(body))
    if constraint is not None:
        sampling["structured_output"] = constraint
    priority = _int(body, "priority", -MAX_INT32, MAX_INT32, default=0)
    if priority:  # the workers' --scheduling-policy decides (fcfs refuses it, as vLLM)
        sampling["priority"] = priority
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
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
        user=_str(body, "user"),
        safety_identifier=_str(body, "safety_identifier"),
        structured_param=structured_param,
    )
    return fields, sampling


def _logits_shaping(body: dict) -> dict:
    """logit_bias (OpenAI), bad_words, allowed_token_ids and truncate_prompt_tokens
    (vLLM) as SamplingParams fields; token ids are checked against the vocabulary by
    the worker."""
    out: dict = {}
    bias = _get(body, "logit_bias", _MISSING)
    if bias is not _MISSING:
        if not isinstance(bias, dict):
            raise bad_request("'logit_bias' must be an object of token id -> bias", "logit_bias")
        table = {}
        for k, v in bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise bad_request(
                    f"'logit_bias' key {k!r} is not a token id", "logit_bias"
                ) from None
            if not 0 <= tid <= MAX_TOKEN_ID:
                raise bad_request(f"'logit_bias' has an out-of-range token id {k}", "logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise bad_request(
                    f"'logit_bias' values must be numbers in [-100, 100], got {v!r} for {k}",
                    "logit_bias",
                )
            table[tid] = float(v)
        if table:
            out["logit_bias"] = table
    words = _get(body, "bad_words", [])
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise bad_request("'bad_words' must be a list of non-empty strings", "bad_words")
    if words:
        out["bad_words"] = words
    allowed = _get(body, "allowed_token_ids", _MISSING)
    if allowed is not _MISSING:
        if not isinstance(allowed, list):
            raise bad_request(
                "'allowed_token_ids' must be a list of token ids", "allowed_token_ids"
            )
        out["allowed_token_ids"] = common_pb2.TokenIds(
            ids=_token_list(allowed, "allowed_token_ids")
        )
    keep = _int(body, "truncate_prompt_tokens", -1, MAX_INT32)
    if keep is not None:
        if keep == 0:
            raise bad_request(
                "'truncate_prompt_tokens' must be -1 (max_model_len) or at least 1",
                "truncate_prompt_tokens",
            )
        out["truncate_prompt_tokens"] = keep
    return out


def _content(v: Any, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request("only text content parts ({'type': 'text'}) are supported", param)
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request("a text content part needs a string 'text'", param)
            parts.append(text)
        return "\n".join(parts)
    raise bad_request("message content must be a string or a list of text parts", param)


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
# (services/models/tokenizer.py holds the same set, checked equal by a test).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _chat_prompt(body: dict) -> Prompt:
    """The conversation and vLLM's chat options: add_generation_prompt (default true),
    continue_final_message (the final message stays open and generation continues it;
    exclusive with add_generation_prompt, as in vLLM) and chat_template_kwargs."""
    add_generation_prompt = _bool(body, "add_generation_prompt", default=True)
    continue_final_message = _bool(body, "continue_final_message")
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            "(set add_generation_prompt to false)",
            "continue_final_message",
        )
    kwargs = _get(body, "chat_template_kwargs", _MISSING)
    if kwargs is _MISSING:
        kwargs = None
    elif not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    else:
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise bad_request(
                    f"chat_template_kwargs may not set {key!r}: it is an argument of the "
                    "template call (a request field where the request has one)",
                    f"chat_template_kwargs.{key}",
                )
    messages, message_tools = _messages(body)
    return Prompt(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=kwargs or None,
        # with tool_choice "none" too: vLLM's default since 0.10 (the template still
        # describes the tools; its --exclude-tools-when-tool-choice-none is not offered)
        tools=parse_tools(body),
        message_tools=message_tools if any(message_tools) else None,
    )


def parse_chat_request(body: Any) -> GenerationRequest:
    fields, sampling = _common(body, "chat")
    prompt = _chat_prompt(body)

    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
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
    return GenerationRequest(
        prompts=[prompt],
        logprobs=logprobs,
        sampling=sampling,
        tool_choice=tool_choice,
        tool_choice_name=tool_name,
        parallel_tool_calls=parallel,
        **fields,
    )


def _messages(body: dict) -> tuple[list[tuple[str, str]], list[dict | None]]:
    """(role, content) per message, and its tool fields (router/tools.py) or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    conv: list[tuple[str, str]] = []
    extras: list[dict | None] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"unsupported message role {role!r}; use system, user, assistant or tool",
                f"messages[{i}].role",
            )
        extras.append(message_tool_fields(m, role, i))
        if m.get("content") is None and extras[-1] and "tool_calls" in extras[-1]:
            conv.append((CHAT_ROLES[role], ""))  # an assistant turn of calls only
            continue
        if "content" not in m or m["content"] is None:
            raise bad_request("each message needs content", f"messages[{i}].content")
        conv.append((CHAT_ROLES[role], _content(m["content"], i)))
    return conv, extras


def _prompts(v: Any) -> list[Prompt]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token id lists",
            "prompt",
        )
    if all(_is_int(t) for t in v):
        return [Prompt(token_ids=_token_list(v, "prompt"))]
    if all(isinstance(p, str) for p in v):
        if any(not p for p in v):
            raise bad_request("'prompt' must not be empty", "prompt")
        return [Prompt(text=p) for p in v]
    if all(isinstance(p, list) for p in v):
        return [Prompt(token_ids=_token_list(p, "prompt")) for p in v]
    raise bad_request("'prompt' mixes strings, token ids and lists", "prompt")


def parse_completion_request(body: Any) -> GenerationRequest:
    fields, sampling = _common(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompts = _prompts(body["prompt"])
    echo = _bool(body, "echo")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
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


# --------------------------------------------------------------------------- /tokenize


@dataclass
class TokenizeRequest:
    """vLLM's /tokenize body: a completion prompt (text) or a chat conversation."""

    model: str | None
    prompt: Prompt
    add_special_tokens: bool
    return_token_strs: bool


_TOKENIZE_TEXT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
    "tools",
    "return_token_strs",
}
_TOKENIZE_UNSUPPORTED = {
    "tools": "tools apply to chat 'messages' only",
    "chat_template": "a per-request chat_template is not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
}


def _only_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in _TOKENIZE_UNSUPPORTED:
            if value in (None, [], {}, ""):
                continue
            raise bad_request(_TOKENIZE_UNSUPPORTED[name], name)
        raise bad_request(f"unknown field '{name}'", name)


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_unicode(body)
    if "messages" in body:
        _only_fields(body, _TOKENIZE_CHAT_FIELDS)
        prompt = _chat_prompt(body)
        special_default = False  # the chat template writes the special tokens
    else:
        _only_fields(body, _TOKENIZE_TEXT_FIELDS)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        prompt = Prompt(text=text)
        special_default = True
    return TokenizeRequest(
        model=_str(body, "model"),
        prompt=prompt,
        add_special_tokens=_bool(body, "add_special_tokens", default=special_default),
        return_token_strs=_bool(body, "return_token_strs"),
    )


def parse_detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize body -> (model, token ids)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _only_fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    return _str(body, "model"), _token_list(tokens, "tokens") if tokens else []
