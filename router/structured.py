"""Structured-output request fields -> one pdpb StructuredOutput.

OpenAI's response_format (json_schema, json_object, text), vLLM's structured_outputs
({json | regex | choice | grammar | json_object}) and its older guided_json,
guided_regex, guided_choice and guided_grammar. At most one constraint per request.
The router checks shapes only (it has no tokenizer, nor xgrammar); the worker compiles
the constraint and refuses one that does not compile with a message starting
"structured output", which name_field() turns back into the field's name."""

from __future__ import annotations

import json
from typing import Any

from pdpb.v1 import common_pb2
from router.errors import APIError, bad_request

FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's StructuredOutputsParams options and the values that ask for nothing
_NO_OP_OPTIONS = {
    "disable_fallback": (False,),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}
_WORKER_MARK = "structured output"


def parse(body: dict) -> tuple[common_pb2.StructuredOutput | None, str | None]:
    """The request's constraint and the field it came from; (None, None) without one."""
    found: list[tuple[common_pb2.StructuredOutput, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        so = _response_format(fmt)
        if so is not None:
            found.append((so, "response_format"))
    opts = body.get("structured_outputs")
    if opts is not None:
        found += [(so, "structured_outputs") for so in _structured_outputs(opts)]
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((_constraint(kind, body[name], name), name))
    if len(found) > 1:
        names = [param for _, param in found]
        kinds = [so.kind for so, _ in found]
        raise bad_request(
            f"only one structured output constraint per request: got {kinds[0]} "
            f"({names[0]}) and {kinds[1]} ({names[1]})",
            names[1],
        )
    return found[0] if found else (None, None)


def _response_format(fmt: Any) -> common_pb2.StructuredOutput | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise bad_request("'response_format' must be an object", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(kind="json_object")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param,
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", param)
    # "strict" changes nothing here: the schema is always enforced
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", param)
    return common_pb2.StructuredOutput(kind="json", spec=json.dumps(schema, ensure_ascii=False))


def _structured_outputs(opts: Any) -> list[common_pb2.StructuredOutput]:
    param = "structured_outputs"
    if not isinstance(opts, dict):
        raise bad_request("'structured_outputs' must be an object", param)
    found = []
    for key, value in opts.items():
        if key in ("json", "regex", "choice", "grammar"):
            if value is not None:
                found.append(_constraint(key, value, f"{param}.{key}"))
        elif key == "json_object":
            if value not in (None, False, True):
                raise bad_request(f"'{param}.json_object' must be a boolean", param)
            if value:
                found.append(common_pb2.StructuredOutput(kind="json_object"))
        elif key in _NO_OP_OPTIONS:
            if not any(type(value) is type(v) and value == v for v in _NO_OP_OPTIONS[key]):
                raise bad_request(f"{param}.{key} is not supported", param)
        else:
            raise bad_request(f"unknown field {param}.{key}", param)
    if not found:
        raise bad_request(
            f"'{param}' needs one of json, regex, choice, grammar or json_object", param
        )
    if len(found) > 1:
        raise bad_request(f"'{param}' may hold only one constraint", param)
    return found


def _constraint(kind: str, value: Any, where: str) -> common_pb2.StructuredOutput:
    """One constraint's value, shape-checked; errors name the request field."""
    param = where.split(".")[0]
    if kind == "json":
        if isinstance(value, str):  # vLLM takes a schema as text too
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{where}' is not valid JSON", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"'{where}' must be a JSON schema object", param)
        return common_pb2.StructuredOutput(kind=kind, spec=json.dumps(value, ensure_ascii=False))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"'{where}' must be a non-empty list of strings", param)
        return common_pb2.StructuredOutput(kind=kind, spec=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}' must be a non-empty string", param)
    return common_pb2.StructuredOutput(kind=kind, spec=value)


def name_field(error: APIError, details: str | None, param: str | None) -> APIError:
    """A worker's 400 about the structured output names the field it came from (and
    one about priority scheduling names 'priority')."""
    if error.status == 400 and param and (details or "").startswith(_WORKER_MARK):
        error.param = param
    elif error.status == 400 and (details or "").startswith("priority scheduling"):
        error.param = "priority"
    return error
