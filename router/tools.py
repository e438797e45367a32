"""Tool calling on /v1/chat/completions, as vLLM's `--enable-auto-tool-choice
--tool-call-parser NAME` does it.

Request side: `tools`, `tool_choice`, `parallel_tool_calls` and the tool fields of
messages (an assistant's `tool_calls`, a tool result's `tool_call_id`) are checked here
and travel to the decode worker, whose chat template renders them (HF templates take
`tools=[...]` and read `message.tool_calls` with arguments as objects).

Response side: a parser (router/tool_parsers.py, re-exported here) finds the model's
calls in its output text."""

from __future__ import annotations

import json
from typing import Any

from pdpb.v1 import common_pb2
from router.errors import bad_request
from router.tool_parsers import (
    TOOL_PARSERS,
    ForcedToolParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
    make_tool_parser,
)

__all__ = [
    "TOOL_PARSERS",
    "ForcedToolParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "check_tool_choice",
    "forced_constraint",
    "make_tool_parser",
    "message_tool_fields",
    "parse_tool_choice",
    "parse_tools",
]


# --------------------------------------------------------------------------- requests


def parse_tools(body: dict) -> list[dict] | None:
    """The request's `tools`, checked, as sent: the chat template reads the whole
    {"type": "function", "function": {...}} objects (vLLM passes them the same way)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                "only function tools ({'type': 'function', ...}) are supported", where
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request("a function tool needs a 'function' object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(
                "a function needs a non-empty string 'name'", f"{where}.function.name"
            )
        if name in names:
            raise bad_request(f"two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad_request(f"'{key}' must be a {kind.__name__}", f"{where}.function.{key}")
    return tools


def parse_tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None, bool]:
    """(tool_choice, the named function or None, parallel_tool_calls). Default "auto"
    with tools, "none" without, as OpenAI and vLLM. "required" and a named function
    are forced through a JSON-schema constraint on the output (forced_constraint)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice, name = body.get("tool_choice"), None
    if choice is None:
        return ("auto" if tools else "none"), None, parallel is not False
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        if fn.get("name") not in {t["function"]["name"] for t in tools or ()}:
            raise bad_request(f"tool {fn.get('name')!r} is not in 'tools'", "tool_choice")
        choice, name = "named", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or a named function",
            "tool_choice",
        )
    if choice != "none" and not tools:
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    return choice, name, parallel is not False


def forced_constraint(
    tools: list[dict], choice: str, name: str | None, parallel: bool
) -> common_pb2.StructuredOutput:
    """The output a forced tool_choice must be: a named function's arguments (its
    parameters schema), or for "required" a list of {"name", "parameters"} calls
    (one at most without parallel_tool_calls), as vLLM constrains them."""
    params = {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT for t in tools}
    if choice == "named":
        schema = params[name]
    else:
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in params.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not parallel:
            schema["maxItems"] = 1
    return common_pb2.StructuredOutput(kind="json", spec=json.dumps(schema, ensure_ascii=False))


_ANY_OBJECT = {"type": "object"}


def check_tool_choice(tool_choice: str, parser: ToolParser | None) -> None:
    """vLLM's rule: "auto" needs the operator's --enable-auto-tool-choice and
    --tool-call-parser (without a parser the calls would come back as plain text)."""
    if tool_choice == "auto" and parser is None:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set on the router",
            "tool_choice",
        )


def _arguments(v: Any, where: str) -> dict:
    """A call's arguments (a JSON string in OpenAI's API) as the object templates
    expect (they write `arguments | tojson`); empty: {} (vLLM does the same)."""
    if isinstance(v, dict):
        return v
    if v is None or v == "":
        return {}
    try:
        args = json.loads(v) if isinstance(v, str) else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad_request("tool call arguments must be a JSON object (as a string)", where)
    return args


def message_tool_fields(m: dict, role: str, i: int) -> dict | None:
    """The tool fields of message i for the template, or None: a tool result's
    tool_call_id, an assistant's tool_calls (arguments parsed into objects)."""
    where = f"messages[{i}]"
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                "a tool message needs a string 'tool_call_id'", f"{where}.tool_call_id"
            )
        return {"tool_call_id": call_id}
    calls = m.get("tool_calls")
    if role != "assistant" or calls is None or calls == []:
        if calls:
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        return None
    if not isinstance(calls, list):
        raise bad_request("'tool_calls' must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad_request("a tool call is {'id', 'type': 'function', 'function'}", at)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("a tool call needs a function name", f"{at}.function.name")
        if not isinstance(call.get("id"), str):
            raise bad_request("a tool call needs a string 'id'", f"{at}.id")
        args = _arguments(fn.get("arguments"), f"{at}.function.arguments")
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return {"tool_calls": out}
