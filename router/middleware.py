"""aiohttp middlewares: request id + error shaping + request metrics, auth, and the
opt-in request-body log."""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from router.errors import APIError
from router.limits import key_digest
from router.request_id import HEADER, REQUEST_ID, REQUEST_LOG, RequestLog, accept_or_create
from router.state import STATE

log = logging.getLogger("pdserve.router")


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


@web.middleware
async def request_context(request: web.Request, handler):
    """X-Request-Id in and out, OpenAI-shaped errors (never a bare 500 for bad input),
    and the requests-by-status counter."""
    rid = accept_or_create(request.headers.get(HEADER))
    request[REQUEST_ID] = rid
    request[REQUEST_LOG] = RequestLog(log, rid)
    metrics = request.app[STATE].metrics
    status = 500
    try:
        try:
            resp = await handler(request)
        except APIError as e:
            resp = e.response()
        except web.HTTPException as e:  # 404 / 405 from routing, 413 from aiohttp
            resp = APIError(e.status, e.text or e.reason).response()
            resp.headers.update({k: v for k, v in e.headers.items() if k == "Allow"})
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away
            request[REQUEST_LOG].info("%s %s: client disconnected", request.method, request.path)
            raise
        except Exception:
            request[REQUEST_LOG].exception("%s %s failed", request.method, request.path)
            resp = APIError(500, "internal router error", code="internal_error").response()
        status = resp.status
        if not resp.prepared:
            resp.headers[HEADER] = rid
        return resp
    finally:
        metrics.requests.labels(_endpoint(request), str(status)).inc()


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def api_key_id(request: web.Request) -> bytes | None:
    """Who is asking, for per-key limits: the digest of the request's API key."""
    token = _bearer(request)
    return None if token is None else key_digest(token)


def _matches(token: str | None, keys) -> bool:
    if token is None:
        return False
    # every key is compared (no short-circuit): the time taken says nothing about which
    # key matched, or how many there are before it
    digest, ok = key_digest(token), False
    for key in keys:
        ok |= hmac.compare_digest(digest, key_digest(key))
    return ok


_KEYED = ("/tokenize", "/detokenize")
ADMIN_OFF = (
    "the admin endpoints are off: start the router with --admin-token (or "
    "PDSERVE_ADMIN_TOKEN) to enable them"
)
_LOGGED_BYTES = 64 * 1024  # of each body, with --enable-log-requests


@web.middleware
async def auth(request: web.Request, handler):
    """API keys guard /v1 and the tokenizer endpoints (they reach the workers); the
    admin token guards /admin, which is off (404) without one. Probes, /version and
    metrics are open."""
    config = request.app[STATE].config
    path = request.path
    if (path.startswith("/v1/") or path in _KEYED) and config.api_keys:
        token = _bearer(request)
        if not _matches(token, config.api_keys):
            msg = (
                "You didn't provide an API key (Authorization: Bearer <key>)."
                if token is None
                else "Incorrect API key provided."
            )
            raise APIError(401, msg, code="invalid_api_key")
    elif path.startswith("/admin/"):
        if config.admin_token is None:
            raise APIError(404, ADMIN_OFF, code="not_found")
        token = _bearer(request) or request.headers.get("X-Admin-Token")
        if not _matches(token, [config.admin_token]):
            raise APIError(401, "a valid admin token is required", code="invalid_admin_token")
    return await handler(request)


@web.middleware
async def log_requests(request: web.Request, handler):
    """--enable-log-requests: every request body that can carry a prompt, at INFO."""
    if request.method == "POST" and (request.path.startswith("/v1/") or request.path in _KEYED):
        limit = request.app[STATE].config.max_body_bytes
        if request.content_length is None or request.content_length <= limit:
            try:
                raw = await request.read()  # cached: the handler reads it again
            except web.HTTPRequestEntityTooLarge:
                # a second read would resume mid-body: answer as the handler would
                msg = f"the request body exceeds {limit} bytes"
                raise APIError(413, msg, code="request_too_large") from None
            more = (
                f" ... ({len(raw) - _LOGGED_BYTES} more bytes)" if len(raw) > _LOGGED_BYTES else ""
            )
            request[REQUEST_LOG].info(
                "%s %s body: %s%s",
                request.method,
                request.path,
                raw[:_LOGGED_BYTES].decode("utf-8", "replace"),
                more,
            )
    return await handler(request)
