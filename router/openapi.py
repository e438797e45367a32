"""GET /openapi.json: the router's OpenAPI 3.1 document.

Paths are the routes the app registers (router/routes.py); request bodies are the
schemas of router/request_schemas.py, made from the tables the validator reads
(router/catalog.py: the scalar specs, the honoured and the refused fields) and from the
app's request limits (router/bounds.py), so the document says what this router
accepts, bounds included; a field the parser honours without a schema is an error when
the document is built, so the two cannot drift apart."""

from __future__ import annotations

import importlib.metadata

from aiohttp import web

from router.bounds import RequestLimits
from router.request_schemas import detokenize_schema, request_schema, tokenize_schema

OPENAPI_VERSION = "3.1.0"


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH
        return "unknown"


# ------------------------------------------------------------------------------ paths

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def _json(ref_or_schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": ref_or_schema}}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: int) -> dict:
    text = {
        400: "invalid request: the error names the field (param)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "the request body is too large",
        415: "a Content-Encoding other than gzip, deflate or identity",
        429: "too many requests or the workers are out of capacity (Retry-After)",
        503: "no worker can serve the request",
    }
    return {str(s): _json(_ref("Error"), text[s]) for s in statuses}


def _generation(kind: str, summary: str) -> dict:
    schema = "ChatCompletionRequest" if kind == "chat" else "CompletionRequest"
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(schema)}},
        },
        "responses": {
            "200": {
                "description": "the completion (OpenAI's shape), or with stream: true "
                "server-sent events ending with data: [DONE]",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **_errors(400, 401, 404, 413, 415, 429, 503),
        },
        "security": [{"bearer": []}, {}],
    }


def _plain(summary: str, description: str, content: str = "application/json") -> dict:
    return {
        "summary": summary,
        "responses": {"200": {"description": description, "content": {content: {}}}},
    }


# (method, path) -> operation; every route router/routes.py registers has one
OPERATIONS = {
    ("POST", "/v1/chat/completions"): _generation("chat", "OpenAI chat completions"),
    ("POST", "/v1/completions"): _generation("completion", "OpenAI completions"),
    ("GET", "/v1/models"): {
        **_plain("the served models", "{object: list, data: [model cards]}"),
        "security": [{"bearer": []}, {}],
    },
    ("GET", "/v1/models/{model}"): {
        "summary": "one model card",
        "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "responses": {"200": {"description": "the model card"}, **_errors(401, 404)},
        "security": [{"bearer": []}, {}],
    },
    ("POST", "/tokenize"): {
        "summary": "vLLM's /tokenize: a prompt or a conversation -> token ids",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("TokenizeRequest")}}},
        "responses": {
            "200": {"description": "{count, max_model_len, tokens, token_strs}"},
            **_errors(400, 401, 404, 413, 415, 503),
        },
        "security": [{"bearer": []}, {}],
    },
    ("POST", "/detokenize"): {
        "summary": "vLLM's /detokenize: token ids -> text",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("DetokenizeRequest")}}},
        "responses": {"200": {"description": "{prompt}"}, **_errors(400, 401, 404, 413, 415, 503)},
        "security": [{"bearer": []}, {}],
    },
    ("GET", "/version"): _plain("the pdserve version", "{version}"),
    ("GET", "/health"): _plain("liveness", "{status: ok}"),
    ("GET", "/ready"): {
        **_plain("readiness: a prefill/decode pair is usable", "ready"),
        "responses": {
            "200": {"description": "{ready, healthy_prefill, healthy_decode, pairs}"},
            "503": {"description": "not ready (same body)"},
        },
    },
    ("GET", "/metrics"): _plain("Prometheus metrics", "text exposition format", "text/plain"),
    ("GET", "/openapi.json"): _plain("this document", "OpenAPI 3.1"),
}  # fmt: skip


def document(app: web.Application, limits: RequestLimits) -> dict:
    """The OpenAPI document of `app`'s routes (the /admin ones aside)."""
    paths: dict[str, dict] = {}
    for resource in app.router.resources():
        path = resource.canonical
        if path.startswith("/admin/"):
            continue  # operator endpoints, off without an admin token
        for route in resource:
            if route.method == "HEAD":
                continue
            op = OPERATIONS.get((route.method, path))
            if op is None:
                raise AssertionError(f"openapi: no description of {route.method} {path}")
            paths.setdefault(path, {})[route.method.lower()] = op
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "pdserve router",
            "version": _version(),
            "description": "OpenAI-compatible chat / completions and vLLM's extras, served "
            "by prefill/decode-disaggregated workers. Request bodies list every field the "
            "router accepts, with this router's limits; any other field is a 400 naming it.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                "ChatCompletionRequest": request_schema("chat", limits),
                "CompletionRequest": request_schema("completion", limits),
                "TokenizeRequest": tokenize_schema(limits),
                "DetokenizeRequest": detokenize_schema(limits),
                "Error": _ERROR,
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key, when the router has any (--api-key)",
                }
            },
        },
    }
