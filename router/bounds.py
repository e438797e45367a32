"""Bounds on request fields (issue 18): every list and string a client sends is finite.

RequestLimits holds them (RouterConfig.limits). Each field's help says what it bounds;
the command line (`pdserve router --max-stop-sequences N`...), the validation errors
and /openapi.json are made from this one class. Over a limit: a 400 naming the field
and the limit, with OpenAI's codes (array_above_max_length, string_above_max_length)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _limit(default: int, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    max_stop_sequences: int = _limit(
        64, "stop strings per request, and stop_token_ids (OpenAI allows 4, vLLM any number)"
    )
    max_stop_chars: int = _limit(1024, "characters of each stop string and each bad word")
    max_bad_words: int = _limit(256, "bad_words per request")
    max_logit_bias: int = _limit(1024, "logit_bias entries per request")
    max_token_ids: int = _limit(262_144, "allowed_token_ids per request; token ids per /detokenize")
    max_messages: int = _limit(4096, "messages per chat conversation")
    max_message_chars: int = _limit(
        1_048_576, "characters of one message's content (OpenAI's limit)"
    )
    max_prompts: int = _limit(256, "prompts in one batch completion")
    max_choices: int = _limit(
        1024, "choices of one request, prompts x n: each is a request to the workers"
    )
    max_prompt_bytes: int = _limit(
        2 * 1024 * 1024,
        "the prompts' total size in bytes as sent to the workers (text as UTF-8; chat "
        "messages with their tools and chat_template_kwargs; token ids); keep it well under "
        "the workers' gRPC message limit (64 MiB)",
    )
    max_constraint_bytes: int = _limit(
        256 * 1024,
        "size of a structured output constraint in bytes (JSON schema, regex, grammar, "
        "choices; the one tool_choice required / named makes from the tools): the workers "
        "compile it",
    )
    max_tools: int = _limit(128, "tools per chat request (OpenAI's limit)")
    max_json_depth: int = _limit(64, "nesting depth of arrays and objects in a request body")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")
        if self.max_json_depth < 8:
            # messages[i].content[j], tool calls and schemas need a few levels
            raise ValueError(f"max_json_depth must be at least 8, got {self.max_json_depth}")


def limit_fields() -> list[tuple[str, int, str]]:
    """(name, default, help) of every limit: the flags and the docs."""
    return [(f.name, f.default, f.metadata["help"]) for f in fields(RequestLimits)]


DEFAULT_LIMITS = RequestLimits()
