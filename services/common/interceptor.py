"""The gRPC edge of a worker: one server interceptor answers UNAVAILABLE while the
model loads and maps the domain's exceptions to status codes, so each servicer method
is only "convert protobuf, call, convert back".

  KVLayoutMismatch, UnknownPeerError          -> FAILED_PRECONDITION
  ValueError (bad input)                      -> INVALID_ARGUMENT
  NoFreeBlocksError                           -> RESOURCE_EXHAUSTED
  RequestExistsError                          -> ALREADY_EXISTS
  RequestAbortedError                         -> CANCELLED
  KVTransferError, PeerFailedError            -> UNAVAILABLE
  anything else (EngineFailedError, bugs)     -> INTERNAL, logged with the request id
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from kvtransfer import KVLayoutMismatch, KVTransferError
from services.common.errors import (
    PeerFailedError,
    RequestAbortedError,
    RequestExistsError,
    UnknownPeerError,
)
from services.engine import NoFreeBlocksError

log = logging.getLogger(__name__)

# most specific first: KVLayoutMismatch is a ValueError
_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (KVLayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownPeerError, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoFreeBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (RequestAbortedError, grpc.StatusCode.CANCELLED),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (PeerFailedError, grpc.StatusCode.UNAVAILABLE),
]


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


class WorkerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method of pdserve's own services (/pdpb.*); the health service is
    left alone: it must answer while the model loads."""

    def __init__(self, is_ready: Callable[[], bool], prefix: str = "/pdpb."):
        self._prefix = prefix
        self._is_ready = is_ready
        self._handlers: set[asyncio.Task] = set()  # the tasks running a call's handler

    async def finish_handlers(self, timeout: float) -> int:
        """At shutdown, once the server has stopped: cancel the handlers still running
        and wait (up to timeout) until their cleanup (aborting requests, freeing
        blocks) has run, so it runs before the engine and the KV connector close
        rather than against closed ones. Returns how many were still running."""
        running = [t for t in self._handlers if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout)
        return len(running)

    @contextlib.contextmanager
    def _tracked(self):
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            yield
        finally:
            self._handlers.discard(task)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._bidi(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # no client-streaming-only methods in pdpb

    def _unary(self, behavior, method: str):
        async def wrapped(request, context):
            await self._require_ready(context)
            with self._tracked():
                try:
                    return await behavior(request, context)
                except Exception as e:
                    await self._abort(e, request, context, method)

        return wrapped

    def _stream(self, behavior, method: str):
        async def wrapped(request, context):
            await self._require_ready(context)
            with self._tracked():
                try:
                    async for response in behavior(request, context):
                        yield response
                except Exception as e:
                    await self._abort(e, request, context, method)

        return wrapped

    def _bidi(self, behavior, method: str):
        async def wrapped(request_iterator, context):
            await self._require_ready(context)
            with self._tracked():
                try:
                    async for response in behavior(request_iterator, context):
                        yield response
                except Exception as e:
                    await self._abort(e, None, context, method)

        return wrapped

    async def _require_ready(self, context) -> None:
        if not self._is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def _abort(self, error: Exception, request, context, method: str) -> None:
        if isinstance(error, (grpc.aio.AbortError, asyncio.CancelledError)):
            raise error  # context.abort() already chose the status; or the call is gone
        code = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            rid = getattr(request, "request_id", "") or _metadata(context, "x-request-id")
            log.error("%s failed for request %r", method, rid, exc_info=error)
            await context.abort(code, f"internal error ({type(error).__name__}): {error}")
        await context.abort(code, str(error))


def _metadata(context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""
