"""Structured-output request fields -> one pdpb StructuredOutput.

OpenAI's response_format (json_schema, json_object, text; vLLM's structural_tag), vLLM's
structured_outputs ({json | regex | choice | grammar | json_object | structural_tag}) and its older guided_json,
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
    if kind == "structural_tag":
        tag = {k: v for k, v in fmt.items() if k != "type"}
        return structural_tag(tag, param)
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be 'text', 'json_object', 'json_schema' or "
            f"'structural_tag', got {kind!r}",
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
        elif key == "structural_tag":
            if value is not None:  # vLLM: the tag as a JSON string
                try:
                    tag = json.loads(value) if isinstance(value, str) else None
                except ValueError:
                    tag = None
                if not isinstance(tag, dict):
                    raise bad_request(f"'{param}.structural_tag' must be a JSON object", param)
                tag.pop("type", None)
                found.append(structural_tag(tag, param))
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


def structural_tag(tag: dict, param: str) -> common_pb2.StructuredOutput:
    """A structural tag (xgrammar's): free text until a trigger, then a tagged section
    whose content is constrained. vLLM's two shapes: {"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}, or {"format": {...}} (xgrammar's format)."""
    where = f"{param}.structural_tag" if param == "structured_outputs" else param
    if "format" in tag:
        if set(tag) != {"format"} or not isinstance(tag["format"], dict):
            raise bad_request(f"'{where}' with format takes one object, format", param)
        spec = {"type": "structural_tag", "format": tag["format"]}
        return common_pb2.StructuredOutput(
            kind="structural_tag", spec=json.dumps(spec, ensure_ascii=False)
        )
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if set(tag) - {"structures", "triggers"}:
        raise bad_request(f"'{where}' takes structures and triggers, or format", param)
    if not isinstance(structures, list) or not structures:
        raise bad_request(f"'{where}.structures' must be a non-empty list", param)
    for s in structures:
        ok = isinstance(s, dict) and set(s) <= {"begin", "schema", "end"}
        if not ok or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise bad_request(f"each of '{where}.structures' needs begin, schema, end", param)
        if not isinstance(s.get("schema"), (dict, bool)):
            raise bad_request(f"'{where}.structures[].schema' must be a JSON schema", param)
    if not isinstance(triggers, list) or not triggers:
        raise bad_request(f"'{where}.triggers' must be a non-empty list of strings", param)
    if not all(isinstance(t, str) and t for t in triggers):
        raise bad_request(f"'{where}.triggers' must be a non-empty list of strings", param)
    spec = {"structures": structures, "triggers": triggers}
    return common_pb2.StructuredOutput(
        kind="structural_tag", spec=json.dumps(spec, ensure_ascii=False)
    )


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
