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
from router.errors import bad_request

MAX_N = 128
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**32 - 1
MAX_UINT32 = 2**32 - 1  # max_tokens, min_tokens travel as uint32
MAX_INT32 = 2**31 - 1  # top_k travels as int32
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MISSING = object()

# Parameters we do not implement: a non-default value is an error rather than silence.
_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}


@dataclass
class Prompt:
    """One worker prompt: exactly one of text, token_ids, messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[tuple[str, str]] | None = None

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
            msgs = [common_pb2.ChatMessage(role=r, content=c) for r, c in self.messages]
            return {"chat": common_pb2.Conversation(messages=msgs)}
        return {"text": self.text}


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    prompts: list[Prompt]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    max_tokens: int | None = None  # None: until the context is full
    seed: int | None = None
    user: str | None = None
    sampling: dict = field(default_factory=dict)  # SamplingParams fields except seed/max

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
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, ""):
            raise bad_request(why, name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")

    model = _str(body, "model")
    n = _int(body, "n", 1, MAX_N, default=1)
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")

    stream = _bool(body, "stream")
    include_usage = False
    opts = _get(body, "stream_options", _MISSING)
    if opts is not _MISSING:
        if not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage")

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
    fields = dict(
        kind=kind,
        model=model,
        n=n,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        seed=seed,
        user=_str(body, "user"),
    )
    return fields, sampling


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


def parse_chat_request(body: Any) -> GenerationRequest:
    fields, sampling = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    conv: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"unsupported message role {role!r}; use system, user or assistant",
                f"messages[{i}].role",
            )
        if "content" not in m or m["content"] is None:
            raise bad_request("each message needs content", f"messages[{i}].content")
        conv.append((CHAT_ROLES[role], _content(m["content"], i)))

    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    return GenerationRequest(
        prompts=[Prompt(messages=conv)], logprobs=logprobs, sampling=sampling, **fields
    )


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
    if echo and logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported", "echo")
    return GenerationRequest(
        prompts=prompts, echo=echo, logprobs=logprobs, sampling=sampling, **fields
    )
