"""JSON Schemas of the router's request bodies, for /openapi.json (router/openapi.py).

Scalars come from the tables the validator reads (router/catalog.py) and bounds from
the app's request limits (router/bounds.py); lists and objects (messages, prompt,
tools, ...) are described here by hand, and a field the parser honours without a
schema here is an error when the document is built."""

from __future__ import annotations

from router import catalog
from router.bounds import RequestLimits
from router.fields import MAX_TOKEN_ID
from router.prompts import CHAT_ROLES, RESERVED_TEMPLATE_KWARGS


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _token_ids(max_items: int | None = None, min_items: int = 1) -> dict:
    s: dict = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
        "minItems": min_items,
    }
    if max_items is not None:
        s["maxItems"] = max_items
    return s


# ------------------------------------------------------------------- compound fields


def _message(lim: RequestLimits) -> dict:
    text_part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    tool_call = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {
                        "description": "a JSON object, as a string (OpenAI) or an object",
                        "type": ["string", "object", "null"],
                    },
                },
                "required": ["name"],
            },
        },
        "required": ["id", "function"],
    }
    return {
        "type": "object",
        "description": "content is required, except on an assistant turn of tool_calls",
        "properties": {
            "role": {"enum": sorted(CHAT_ROLES)},
            "content": {
                "anyOf": [
                    {"type": "string", "maxLength": lim.max_message_chars},
                    {"type": "array", "items": text_part},
                    {"type": "null"},
                ],
                "description": f"text, at most {lim.max_message_chars} characters "
                "(text parts joined with newlines)",
            },
            "tool_calls": _nullable({"type": "array", "items": tool_call}),
            "tool_call_id": {"type": "string", "description": "required on tool messages"},
            "function_call": {
                "type": "null",
                "description": "deprecated by OpenAI, not supported: send tool_calls",
            },
        },
        "required": ["role"],
    }


def _tool() -> dict:
    return {
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "description": {"type": ["string", "null"]},
                    "parameters": {"type": ["object", "null"]},
                    "strict": {"type": ["boolean", "null"]},
                },
                "required": ["name"],
            },
        },
        "required": ["type", "function"],
    }


def _compound(lim: RequestLimits) -> dict[str, dict]:
    """The schema of every list / object field, for both endpoints."""
    strings = {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}
    constraint_str = {"type": "string", "minLength": 1}
    out = {
        "stop": {
            "anyOf": [
                strings,
                {"type": "array", "items": strings, "maxItems": lim.max_stop_sequences},
                {"type": "null"},
            ],
            "description": f"at most {lim.max_stop_sequences} strings of at most "
            f"{lim.max_stop_chars} characters",
        },
        "stop_token_ids": _nullable(_token_ids(lim.max_stop_sequences, min_items=0)),
        "stream_options": _nullable(
            {
                "type": "object",
                "properties": {
                    "include_usage": {"type": ["boolean", "null"]},
                    "continuous_usage_stats": {
                        "type": ["boolean", "null"],
                        "description": "needs include_usage",
                    },
                },
                "additionalProperties": {"enum": [False, None]},
                "description": "only with stream: true",
            }
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "maxProperties": lim.max_logit_bias,
                "description": "token id (a string) -> bias",
            }
        ),
        "bad_words": _nullable(
            {
                "type": "array",
                "items": {"type": "string", "pattern": "\\S", "maxLength": lim.max_stop_chars},
                "maxItems": lim.max_bad_words,
            }
        ),
        "allowed_token_ids": _nullable(_token_ids(lim.max_token_ids)),
        "response_format": _nullable(
            {
                "type": "object",
                "properties": {
                    "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
                    "json_schema": {
                        "type": "object",
                        "properties": {
                            "name": {"type": ["string", "null"]},
                            "schema": {"type": ["object", "boolean"]},
                            "strict": {"type": ["boolean", "null"]},
                        },
                        "required": ["schema"],
                    },
                },
                "required": ["type"],
                "description": "json_schema needs json_schema.schema; structural_tag "
                "takes structures (begin, schema, end) and triggers, or format",
            }
        ),
        "structured_outputs": _nullable(
            {
                "type": "object",
                "description": "exactly one of json, regex, choice, grammar, json_object",
                "properties": {
                    "json": {"type": ["object", "boolean", "string", "null"]},
                    "regex": _nullable(constraint_str),
                    "choice": _nullable(
                        {"type": "array", "items": {"type": "string"}, "minItems": 1}
                    ),
                    "grammar": _nullable(constraint_str),
                    "json_object": {"type": ["boolean", "null"]},
                    "disable_fallback": {"enum": [False]},
                    "disable_any_whitespace": {"enum": [False]},
                    "disable_additional_properties": {"enum": [False]},
                    "whitespace_pattern": {"type": "null"},
                    "structural_tag": _nullable(constraint_str),
                },
                "additionalProperties": False,
                "minProperties": 1,
            }
        ),
        "guided_json": {"type": ["object", "boolean", "string", "null"]},
        "guided_regex": _nullable(constraint_str),
        "guided_choice": _nullable({"type": "array", "items": {"type": "string"}, "minItems": 1}),
        "guided_grammar": _nullable(constraint_str),
        # chat
        "messages": {
            "type": "array",
            "items": _message(lim),
            "minItems": 1,
            "maxItems": lim.max_messages,
            "description": f"at most {lim.max_messages} messages; the conversation with its "
            f"tools and chat_template_kwargs at most {lim.max_prompt_bytes} bytes",
        },
        "chat_template_kwargs": _nullable(
            {
                "type": "object",
                "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
                "description": "variables of the chat template",
            }
        ),
        "tools": _nullable({"type": "array", "items": _tool(), "maxItems": lim.max_tools}),
        "tool_choice": _nullable(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "function"},
                            "function": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}},
                                "required": ["name"],
                            },
                        },
                        "required": ["type", "function"],
                    },
                ]
            }
        ),
        # completions
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": lim.max_prompts,
                },
                _token_ids(),
                {
                    "type": "array",
                    "items": _token_ids(),
                    "minItems": 1,
                    "maxItems": lim.max_prompts,
                },
            ],
            "description": f"text, token ids, or a batch of up to {lim.max_prompts} of "
            f"either; at most {lim.max_prompt_bytes} bytes in all",
        },
    }
    constraint = (
        f"one structured output constraint per request, at most {lim.max_constraint_bytes} "
        "bytes (as JSON for a schema or choices)"
    )
    for name in ("response_format", "structured_outputs", *_GUIDED):
        out[name] = {**out[name], "description": constraint}
    return out


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _asks_for_nothing(why: str, values=()) -> dict:
    """A field that is not supported: accepted only when it asks for nothing (null, an
    empty value, or one of `values`, its defaults)."""
    return {
        "anyOf": [
            {"type": "null"},
            {"type": "array", "maxItems": 0},
            {"type": "object", "maxProperties": 0},
            {"type": "string", "maxLength": 0},
            *({"const": v} for v in values),
        ],
        "description": f"not supported: {why}",
        "deprecated": True,
    }


def _refused(kind: str, name: str) -> dict:
    values = list(catalog.NO_OP.get(name, ()))
    if (kind, name) in catalog.NO_OP_BY_KIND:
        values.append(catalog.NO_OP_BY_KIND[kind, name])
    return _asks_for_nothing(catalog.UNSUPPORTED[name], values)


def request_schema(kind: str, lim: RequestLimits) -> dict:
    """The body of /v1/chat/completions ("chat") or /v1/completions ("completion")."""
    compound = _compound(lim)
    props: dict[str, dict] = {}
    for name in sorted(catalog.HONOURED_FIELDS[kind]):
        if name in catalog.SCALARS[kind]:
            props[name] = catalog.SCALARS[kind][name].schema()
        elif name in compound:
            props[name] = compound[name]
        else:  # a field the parser honours must be described
            raise AssertionError(f"openapi: no schema for the {kind} field {name!r}")
    for name in ("n", "best_of"):  # choices = prompts x n (and best_of = n)
        props[name] = {**props[name], "maximum": min(props[name]["maximum"], lim.max_choices)}
    for name in sorted(catalog.UNSUPPORTED):
        props[name] = _refused(kind, name)
    return {
        "type": "object",
        "properties": props,
        "required": list(catalog.REQUIRED[kind]),
        "additionalProperties": False,
    }


def tokenize_schema(lim: RequestLimits) -> dict:
    compound = _compound(lim)
    refused = {name: _asks_for_nothing(why) for name, why in catalog.TOKENIZE_UNSUPPORTED.items()}
    scalars = {k: v.schema() for k, v in catalog.TOKENIZE_SCALARS.items()}
    text = {
        "type": "object",
        "title": "a prompt",
        "properties": {
            **refused,
            **{k: scalars[k] for k in catalog.TOKENIZE_TEXT_FIELDS if k in scalars},
            "prompt": {
                "type": "string",
                "description": f"at most {lim.max_prompt_bytes} bytes (UTF-8)",
            },
        },
        "required": ["prompt"],
        "additionalProperties": False,
    }
    chat_props = {k: scalars[k] for k in catalog.TOKENIZE_CHAT_FIELDS if k in scalars}
    for k in ("messages", "chat_template_kwargs", "tools"):
        chat_props[k] = compound[k]
    chat = {
        "type": "object",
        "title": "a conversation",
        "properties": {**refused, **chat_props},
        "required": ["messages"],
        "additionalProperties": False,
    }
    return {"oneOf": [text, chat]}


def detokenize_schema(lim: RequestLimits) -> dict:
    return {
        "type": "object",
        "properties": {
            "model": catalog.TOKENIZE_SCALARS["model"].schema(),
            "tokens": _token_ids(lim.max_token_ids, min_items=0),
        },
        "required": ["tokens"],
        "additionalProperties": False,
    }
