"""The field walk's probes for the structured-output fields (used by
tests/router/test_sampling_fields.py): each request carries one constraint, and its
check holds only when the output obeys it (a JSON schema validates with jsonschema, a
regex or grammar matches the whole output, a choice is one of the choices), the
constraint ended the output (finish_reason "stop", not cut by max_tokens), and the
unconstrained greedy reference does not obey it, so the field visibly did something."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
# xgrammar's EBNF, as vLLM's guided_grammar takes it, and the same language as a regex
GRAMMAR = 'root ::= "id-" [0-9] [0-9] [0-9] ("!" | "?")'
GRAMMAR_AS_REGEX = r"id-[0-9]{3}[!?]"
CHOICES = ["alpha", "omega"]
CAPITALISED = r"[A-Z][a-z]{2,5}\."


def _validates(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def _matches(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


def structured_probes(text: Callable[[dict], str]) -> dict:
    """field -> (extra body, check(reply body, reference body)); `text` reads a reply's
    first choice (message content or completion text)."""

    def obeys(test: Callable[[str], bool]):
        def check(body: dict, ref: dict) -> bool:
            done = body["choices"][0]["finish_reason"] == "stop"
            return done and test(text(body)) and not test(text(ref))

        return check

    json_schema = {"name": "color", "schema": COLOR, "strict": True}
    return {
        "response_format": (
            {"max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": json_schema}},
            obeys(_validates(COLOR)),
        ),
        # vLLM takes the schema as JSON text too
        "guided_json": ({"max_tokens": 32, "guided_json": json.dumps(COUNT)}, obeys(_validates(COUNT))),
        "guided_regex": ({"max_tokens": 16, "guided_regex": REGEX}, obeys(_matches(REGEX))),
        "guided_choice": ({"guided_choice": CHOICES}, obeys(lambda s: s in CHOICES)),
        "guided_grammar": (
            {"max_tokens": 16, "guided_grammar": GRAMMAR},
            obeys(_matches(GRAMMAR_AS_REGEX)),
        ),
        "structured_outputs": (
            {"max_tokens": 16, "structured_outputs": {"regex": CAPITALISED}},
            obeys(_matches(CAPITALISED)),
        ),
    }  # fmt: skip


# refused structured-output fields: realistic values, so that the 400 is for the field
# and not for the value's shape
REFUSED_VALUES = {
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": r"[ ]?",
    "structural_tag": json.dumps(
        {"structures": [{"begin": "<n>", "schema": COUNT, "end": "</n>"}], "triggers": ["<n>"]}
    ),
}
