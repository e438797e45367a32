"""Prompts: a chat conversation (messages and vLLM's chat options) or completion
prompts (text, token ids, batches of either) -> Prompt, the unit sent to a worker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdpb.v1 import common_pb2
from router.bounds import RequestLimits
from router.errors import bad_request
from router.fields import MISSING, check_chars, check_items, get, get_bool, is_int, token_list
from router.tools import message_tool_fields, parse_tools

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
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

    def size(self) -> int:
        """Bytes of the prompt as it travels to a worker."""
        if self.token_ids is not None:
            return common_pb2.TokenIds(ids=self.token_ids).ByteSize()
        if self.messages is not None:
            return self.conversation_pb().ByteSize()
        return len(self.text.encode("utf-8"))


def check_prompt_bytes(prompts: list[Prompt], param: str, limits: RequestLimits) -> None:
    total = sum(p.size() for p in prompts)
    if total > limits.max_prompt_bytes:
        raise bad_request(
            f"Invalid '{param}': the prompt is {total} bytes, over the limit of "
            f"{limits.max_prompt_bytes} bytes (the router's --max-prompt-bytes)",
            param,
            code="prompt_above_max_bytes",
        )


# -------------------------------------------------------------------------------- chat


def chat_prompt(body: dict, limits: RequestLimits) -> Prompt:
    """The conversation and vLLM's chat options: add_generation_prompt (default true),
    continue_final_message (the final message stays open and generation continues it;
    exclusive with add_generation_prompt, as in vLLM) and chat_template_kwargs."""
    add_generation_prompt = get_bool(body, "add_generation_prompt", default=True)
    continue_final_message = get_bool(body, "continue_final_message")
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            "(set add_generation_prompt to false)",
            "continue_final_message",
        )
    kwargs = get(body, "chat_template_kwargs", MISSING)
    if kwargs is MISSING:
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
    messages, message_tools = _messages(body, limits)
    tools = body.get("tools")
    if isinstance(tools, list):
        check_items(tools, "tools", limits.max_tools)
    prompt = Prompt(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=kwargs or None,
        # with tool_choice "none" too: vLLM's default since 0.10 (the template still
        # describes the tools; its --exclude-tools-when-tool-choice-none is not offered)
        tools=parse_tools(body),
        message_tools=message_tools if any(message_tools) else None,
    )
    check_prompt_bytes([prompt], "messages", limits)
    return prompt


def _messages(body: dict, limits: RequestLimits) -> tuple[list[tuple[str, str]], list[dict | None]]:
    """(role, content) per message, and its tool fields (router/tools.py) or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    check_items(messages, "messages", limits.max_messages)
    conv: list[tuple[str, str]] = []
    extras: list[dict | None] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "function":
            raise bad_request(
                "the 'function' role is OpenAI's deprecated form of tool results and is not "
                "supported: send a 'tool' message with the call's tool_call_id",
                f"messages[{i}].role",
            )
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"unsupported message role {role!r}; use system, user, assistant or tool",
                f"messages[{i}].role",
            )
        if m.get("function_call") is not None:
            raise bad_request(
                "an assistant's 'function_call' is OpenAI's deprecated form of tool calls and "
                "is not supported: send 'tool_calls'",
                f"messages[{i}].function_call",
            )
        extras.append(message_tool_fields(m, role, i))
        if m.get("content") is None and extras[-1] and "tool_calls" in extras[-1]:
            conv.append((CHAT_ROLES[role], ""))  # an assistant turn of calls only
            continue
        if "content" not in m or m["content"] is None:
            raise bad_request("each message needs content", f"messages[{i}].content")
        conv.append((CHAT_ROLES[role], _content(m["content"], i, limits)))
    return conv, extras


def _content(v: Any, i: int, limits: RequestLimits) -> str:
    param = f"messages[{i}].content"
    if isinstance(v, str):
        check_chars(v, param, limits.max_message_chars)
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
        joined = "\n".join(parts)
        check_chars(joined, param, limits.max_message_chars)
        return joined
    raise bad_request("message content must be a string or a list of text parts", param)


# -------------------------------------------------------------------------- completions


def completion_prompts(v: Any, limits: RequestLimits) -> list[Prompt]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of token id
    lists."""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token id lists",
            "prompt",
        )
    if all(is_int(t) for t in v):
        prompts = [Prompt(token_ids=token_list(v, "prompt"))]
    elif all(isinstance(p, str) for p in v):
        check_items(v, "prompt", limits.max_prompts)
        if any(not p for p in v):
            raise bad_request("'prompt' must not be empty", "prompt")
        prompts = [Prompt(text=p) for p in v]
    elif all(isinstance(p, list) for p in v):
        check_items(v, "prompt", limits.max_prompts)
        prompts = [Prompt(token_ids=token_list(p, "prompt")) for p in v]
    else:
        raise bad_request("'prompt' mixes strings, token ids and lists", "prompt")
    check_prompt_bytes(prompts, "prompt", limits)
    return prompts
