"""OpenAI-shaped errors, and the mapping from worker gRPC status codes to HTTP."""

from __future__ import annotations

import json

import grpc
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
}

# Worker failures worth another pair, as long as no token has reached the client.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,  # cancelled by the worker (shutting down), not by us
        grpc.StatusCode.ALREADY_EXISTS,  # a request id clash: the retry uses a new id
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


class APIError(Exception):
    """An error answered to the client as {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after: int) -> APIError:
    return APIError(
        429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)}
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="service_unavailable")


def from_grpc(code: grpc.StatusCode, details: str | None, retry_after: int) -> APIError:
    """The HTTP answer for a worker's final gRPC status."""
    details = details or code.name
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return bad_request(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(f"the workers are out of capacity: {details}", retry_after)
    if code in RETRYABLE:
        return unavailable(f"no worker could serve the request: {code.name}: {details}")
    return APIError(502, f"worker error: {code.name}: {details}", code="upstream_error")
