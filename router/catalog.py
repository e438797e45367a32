"""The catalogue of request fields: what each endpoint honours, what it refuses by
name, and the type and bounds of every scalar field. The parsers (router/protocol.py)
read the scalars through these specs and /openapi.json describes them from the same
tables, so the two cannot drift."""

from __future__ import annotations

from typing import Any

from router import structured
from router.errors import bad_request
from router.fields import MAX_INT32, MAX_SEED, MAX_UINT32, Bool, Int, Num, Str

MAX_N = 128
MAX_LOGPROBS = 20
MAX_NAME_CHARS = 1024  # model, user, safety_identifier: names, logged with the request

_TOOLS_HINT = 'tools: [{"type": "function", "function": {"name": ..., "parameters": {...}}}]'
# Parameters we do not implement: a non-default value is an error rather than silence.
UNSUPPORTED = {
    # Legacy function calling is refused rather than mapped onto tools: its answers take
    # another shape (message.function_call, finish_reason "function_call", role
    # "function" messages), which we do not produce. (vLLM's request model has neither
    # field: it accepts both and ignores them, which is what this rule forbids.)
    "functions": (
        f"'functions' is OpenAI's deprecated form of tools and is not supported: send {_TOOLS_HINT}"
    ),
    "function_call": (
        "'function_call' is OpenAI's deprecated form of tool_choice and is not supported: "
        "send tool_choice: 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}, with the functions in tools'
    ),
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
NO_OP = {
    "function_call": ("none",),
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
NO_OP_BY_KIND = {("chat", "add_special_tokens"): False, ("completion", "add_special_tokens"): True}

# ----------------------------------------------------------------------- honoured fields

# Scalars: read through these specs (router/fields.py), which also give their schema.
_SCALARS_COMMON = {
    "model": Str(MAX_NAME_CHARS, "the served model's name; may be omitted"),
    "n": Int(1, MAX_N, default=1),
    "best_of": Int(1, MAX_N, doc="only equal to n"),
    "stream": Bool(),
    "max_tokens": Int(1, MAX_UINT32),
    "seed": Int(-(2**63), MAX_SEED),
    "temperature": Num(0.0, 2.0),
    "top_p": Num(0.0, 1.0, lo_open=True),
    "presence_penalty": Num(-2.0, 2.0, default=0.0),
    "frequency_penalty": Num(-2.0, 2.0, default=0.0),
    "user": Str(MAX_NAME_CHARS, "logged with the request"),
    "safety_identifier": Str(MAX_NAME_CHARS, "logged with the request"),
    "top_k": Int(-1, MAX_INT32, doc="-1 or 0: off"),
    "min_p": Num(0.0, 1.0),
    "repetition_penalty": Num(0.0, 2.0, lo_open=True),
    "include_stop_str_in_output": Bool(),
    "ignore_eos": Bool(),
    "min_tokens": Int(0, MAX_UINT32, default=0),
    "skip_special_tokens": Bool(default=True),
    "truncate_prompt_tokens": Int(-1, MAX_INT32, doc="keep the last N prompt tokens, -1: the last max_model_len", exclude=(0,)),
    "prompt_logprobs": Int(0, MAX_LOGPROBS, doc="not with stream"),
    "priority": Int(-MAX_INT32, MAX_INT32, default=0, doc="needs workers on --scheduling-policy priority"),
}  # fmt: skip
SCALARS = {
    "chat": {
        **_SCALARS_COMMON,
        "max_completion_tokens": Int(1, MAX_UINT32, doc="wins over max_tokens"),
        "logprobs": Bool(),
        "top_logprobs": Int(0, MAX_LOGPROBS, doc="needs logprobs: true"),
        "echo": Bool(only=False, doc="completions only"),
        "add_generation_prompt": Bool(default=True),
        "continue_final_message": Bool(doc="needs add_generation_prompt: false"),
        "parallel_tool_calls": Bool(default=True),
    },
    "completion": {
        **_SCALARS_COMMON,
        "echo": Bool(),
        "logprobs": Int(0, MAX_LOGPROBS),
    },
}
# Lists and objects: checked by their own code (protocol.py, prompts.py, tools.py,
# structured.py) and described by hand in router/request_schemas.py.
_COMPOUND_COMMON = (
    "stop", "stop_token_ids", "stream_options", "logit_bias", "bad_words",
    "allowed_token_ids", "response_format", *structured.FIELDS,
)  # fmt: skip
COMPOUND = {
    "chat": (*_COMPOUND_COMMON, "messages", "chat_template_kwargs", "tools", "tool_choice"),
    "completion": (*_COMPOUND_COMMON, "prompt"),
}
# Every parameter each endpoint honours; with UNSUPPORTED, what it knows. Anything
# else is refused by name (OpenAI does the same), so no field is silently ignored.
HONOURED_FIELDS = {kind: set(SCALARS[kind]) | set(COMPOUND[kind]) for kind in SCALARS}
REQUIRED = {"chat": ("messages",), "completion": ("prompt",)}


def read(body: dict, kind: str, name: str):
    """A scalar field's value (its default when absent or null), checked."""
    return SCALARS[kind][name].read(body, name)


def is_no_op(kind: str, name: str, v: Any) -> bool:
    if v is None or (isinstance(v, (list, dict, str)) and not v):
        return True
    allowed = [
        *NO_OP.get(name, ()),
        *([NO_OP_BY_KIND[kind, name]] if (kind, name) in NO_OP_BY_KIND else []),
    ]
    return any(type(v) is type(a) and v == a for a in allowed)


def check_fields(body: dict, kind: str) -> None:
    for name, v in body.items():
        if name in UNSUPPORTED:
            if not is_no_op(kind, name, v):
                raise bad_request(UNSUPPORTED[name], name)
        elif name not in HONOURED_FIELDS[kind]:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)


# ----------------------------------------------------------------------------- /tokenize

TOKENIZE_SCALARS = {
    "model": _SCALARS_COMMON["model"],
    "add_special_tokens": Bool(doc="default: true for a prompt, false for messages"),
    "return_token_strs": Bool(),
    "add_generation_prompt": SCALARS["chat"]["add_generation_prompt"],
    "continue_final_message": SCALARS["chat"]["continue_final_message"],
}
TOKENIZE_TEXT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
    "tools",
    "return_token_strs",
}
TOKENIZE_UNSUPPORTED = {
    "tools": "tools apply to chat 'messages' only",
    "chat_template": "a per-request chat_template is not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
}
DETOKENIZE_FIELDS = {"model", "tokens"}


def only_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in TOKENIZE_UNSUPPORTED:
            if value in (None, [], {}, ""):
                continue
            raise bad_request(TOKENIZE_UNSUPPORTED[name], name)
        raise bad_request(f"unknown field '{name}'", name)
