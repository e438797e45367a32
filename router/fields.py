"""Readers of request fields, and the checks of a whole body.

Each reader returns the field's value, checked, or raises APIError(400) naming it. A
null field is the same as an absent one. The scalar specs (Int, Num, Bool, Str) both
read a field and describe it as JSON Schema, so the validator and /openapi.json share
one table (router/catalog.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from router.errors import APIError, bad_request

MAX_TOKEN_ID = 2**32 - 1
MAX_UINT32 = 2**32 - 1  # max_tokens, min_tokens travel as uint32
MAX_INT32 = 2**31 - 1  # top_k, priority travel as int32
MAX_SEED = 2**63 - 1
MISSING = object()


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, MISSING)
    return default if v is MISSING or v is None else v


def get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = get(body, name, MISSING)
    if v is MISSING:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_float(body: dict, name: str, lo=None, hi=None, lo_open=False, default=None):
    v = get(body, name, MISSING)
    if v is MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", name)
    try:
        v = float(v)
    except OverflowError:  # an integer too large for a double
        raise bad_request(f"'{name}' must be finite", name) from None
    if not math.isfinite(v):
        raise bad_request(f"'{name}' must be finite", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_request(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = get(body, name, MISSING)
    if v is MISSING:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def get_str(body: dict, name: str, max_chars: int | None = None) -> str | None:
    v = get(body, name, MISSING)
    if v is MISSING:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", name)
    if max_chars is not None:
        check_chars(v, name, max_chars)
    return v


# ------------------------------------------------------------------------------- bounds


def too_long(param: str, got: int, limit: int, what: str = "array") -> APIError:
    """OpenAI's wording and codes for an over-long array or string."""
    unit = {"array": "array", "string": "string", "object": "object"}[what]
    return bad_request(
        f"Invalid '{param}': {unit} too long. Expected {'an' if unit != 'string' else 'a'} "
        f"{unit} with maximum length {limit}, but got {'an' if unit != 'string' else 'a'} "
        f"{unit} with length {got} instead.",
        param,
        code=f"{unit}_above_max_length",
    )


def check_items(v: list | dict, param: str, limit: int) -> None:
    if len(v) > limit:
        raise too_long(param, len(v), limit, "object" if isinstance(v, dict) else "array")


def check_chars(v: str, param: str, limit: int) -> None:
    if len(v) > limit:
        raise too_long(param, len(v), limit, "string")


def token_list(v: Any, name: str, max_len: int | None = None) -> list[int]:
    if not v:
        raise bad_request(f"'{name}' must not be empty", name)
    if max_len is not None:
        check_items(v, name, max_len)
    for t in v:
        if not is_int(t):
            raise bad_request(f"'{name}' token ids must be integers", name)
        if not 0 <= t <= MAX_TOKEN_ID:
            raise bad_request(f"'{name}' has an out-of-range token id {t}", name)
    return list(v)


def str_list(
    v: Any, name: str, max_items: int, max_chars: int, *, single: bool = True, strip: bool = False
) -> list[str]:
    """Non-empty strings (with `strip`, not blank either), bounded in count and length:
    stop, bad_words. With `single` a lone string is a list of one."""
    what = "a string or a list of strings" if single else "a list of non-empty strings"
    if single and isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request(f"'{name}' must be {what}", name)
    check_items(v, name, max_items)
    for i, s in enumerate(v):
        if not (s.strip() if strip else s):
            raise bad_request(f"'{name}' strings must be non-empty", name)
        check_chars(s, f"{name}[{i}]", max_chars)
    return v


# ------------------------------------------------------------------------- whole bodies


def check_body(body: Any, max_depth: int) -> None:
    """The body is an object, nested at most max_depth deep, with valid Unicode."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_depth(body, max_depth)
    _check_unicode(body)


def _check_depth(body: dict, max_depth: int) -> None:
    """Iterative (no recursion to exhaust): arrays and objects nested deeper than
    max_depth are refused, naming the outermost field."""
    stack: list[tuple[Any, int, str]] = [(v, 2, k) for k, v in body.items()]
    while stack:
        value, depth, top = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise bad_request(
                f"'{top}' is nested too deeply: at most {max_depth} levels of arrays and "
                "objects are accepted",
                top,
                code="nested_too_deeply",
            )
        stack.extend((c, depth + 1, top) for c in children if isinstance(c, (dict, list)))


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


# ----------------------------------------------------------------------- scalar specs


def _nullable(schema: dict) -> dict:
    return {**schema, "type": [schema["type"], "null"]}


@dataclass(frozen=True)
class Int:
    lo: int | None = None
    hi: int | None = None
    default: int | None = None
    doc: str = ""
    exclude: tuple[int, ...] = ()  # values inside [lo, hi] that are refused

    def read(self, body: dict, name: str):
        v = get_int(body, name, self.lo, self.hi, self.default)
        if v is not None and v in self.exclude:
            raise bad_request(
                f"'{name}' must not be {v}" + (f": {self.doc}" if self.doc else ""), name
            )
        return v

    def schema(self) -> dict:
        s: dict = {"type": "integer"}
        if self.lo is not None:
            s["minimum"] = self.lo
        if self.hi is not None:
            s["maximum"] = self.hi
        if self.exclude:
            s["not"] = {"enum": list(self.exclude)}
        if self.default is not None:
            s["default"] = self.default
        return _described(_nullable(s), self.doc)


@dataclass(frozen=True)
class Num:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    default: float | None = None
    doc: str = ""

    def read(self, body: dict, name: str):
        return get_float(body, name, self.lo, self.hi, self.lo_open, self.default)

    def schema(self) -> dict:
        s: dict = {"type": "number"}
        if self.lo is not None:
            s["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            s["maximum"] = self.hi
        if self.default is not None:
            s["default"] = self.default
        return _described(_nullable(s), self.doc)


@dataclass(frozen=True)
class Bool:
    default: bool = False
    doc: str = ""
    only: bool | None = None  # the one value accepted (chat's echo: false)

    def read(self, body: dict, name: str) -> bool:
        return get_bool(body, name, self.default)

    def schema(self) -> dict:
        s: dict = {"type": ["boolean", "null"], "default": self.default}
        if self.only is not None:
            s["enum"] = [self.only, None]
        return _described(s, self.doc)


@dataclass(frozen=True)
class Str:
    max_chars: int | None = None
    doc: str = ""

    def read(self, body: dict, name: str) -> str | None:
        return get_str(body, name, self.max_chars)

    def schema(self) -> dict:
        s: dict = {"type": ["string", "null"]}
        if self.max_chars is not None:
            s["maxLength"] = self.max_chars
        return _described(s, self.doc)


def _described(schema: dict, doc: str) -> dict:
    return {**schema, "description": doc} if doc else schema
