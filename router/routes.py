"""HTTP handlers: the OpenAI endpoints, models, probes and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pdpb.v1 import decode_pb2
from router import openapi, sse
from router.body import expect_handler, read_json
from router.errors import RETRYABLE, APIError, from_grpc, overloaded, unavailable
from router.middleware import api_key_id
from router.protocol import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from router.request_id import HEADER, REQUEST_ID, REQUEST_LOG
from router.responses import ResponseBuilder
from router.state import STATE, RouterState
from router.tools import check_tool_choice


def resolve_model(state: RouterState, requested: str | None) -> tuple[str, str | None]:
    """(the model name to answer with, the model the workers must report or None)."""
    served = state.config.served_model_name
    if served is not None:
        if requested not in (None, served):
            raise _no_model(requested)
        return served, None
    models = state.registry.models()
    if not models:
        raise unavailable("no healthy workers: the model is not available yet")
    if requested is None:
        return models[0], models[0]
    if requested not in models:
        raise _no_model(requested)
    return requested, requested


def _no_model(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def check_context(state: RouterState, req: GenerationRequest, worker_model: str | None) -> None:
    """Token-id prompts can be checked against the context here; text and chat prompts
    are checked by the worker after tokenizing (INVALID_ARGUMENT -> 400)."""
    limit = state.registry.max_model_len(worker_model)
    if not limit:
        return
    for p in req.prompts:
        if p.token_ids is None:
            continue
        n, m = len(p.token_ids), req.max_tokens or 0
        if req.sampling.get("truncate_prompt_tokens") == -1:  # the worker keeps the last limit
            n = min(n, limit)
        if n >= limit or n + m > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + m} tokens ({n} in the prompt, {m} in the completion). Please "
                f"reduce the length of the prompt or completion.",
                param="max_tokens" if n < limit else "prompt",
                code="context_length_exceeded",
            )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat_request)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion_request)


async def _generate(request: web.Request, parse) -> web.StreamResponse:
    state = request.app[STATE]
    log = request[REQUEST_LOG]
    req = parse(await read_json(request, state.config.max_body_bytes), state.config.limits)
    check_tool_choice(req.tool_choice, state.tool_parser)
    keep = getattr(state.tool_parser, "keeps_special_tokens", False)
    if keep and req.tool_choice == "auto" and "skip_special_tokens" not in req.sampling:
        # its calls start with a special token ([TOOL_CALLS]) that decoding would drop
        req.sampling["skip_special_tokens"] = False
    model, worker_model = resolve_model(state, req.model)
    check_context(state, req, worker_model)
    key = api_key_id(request) if state.config.api_keys else None
    if not state.limit.try_acquire(key):
        raise overloaded(
            f"this API key has {state.limit.per_key} requests in flight, its limit"
            if state.limit.key_full(key)
            else f"the router is at its limit of {state.limit.limit} concurrent requests",
            state.config.retry_after,
        )
    state.metrics.inflight.inc()
    started = time.monotonic()
    builder = ResponseBuilder(
        req, request[REQUEST_ID], model, state.reasoning_parser, state.tool_parser
    )
    try:
        async with state.dispatcher.run(
            req, request[REQUEST_ID], log, worker_model, model_name=model
        ) as run:
            if req.stream:
                resp = await _stream(request, run, builder)
            else:
                resp = await _complete(run, builder)
        usage = builder.usage()
        log.info(
            "%s done: model=%s workers=%s prompt_tokens=%d completion_tokens=%d e2e=%.3fs%s",
            request.path,
            model,
            ",".join(run.pairs[i] for i in sorted(run.pairs)),
            usage["prompt_tokens"],
            usage["completion_tokens"],
            time.monotonic() - started,
            "".join(
                f" {k}={v!r}"
                for k, v in (("user", req.user), ("safety_identifier", req.safety_identifier))
                if v
            ),
        )
        return resp
    except asyncio.CancelledError:
        log.info("%s cancelled (client disconnected); worker requests cancelled", request.path)
        raise
    finally:
        state.limit.release(key)
        state.metrics.inflight.dec()


async def _complete(run, builder: ResponseBuilder) -> web.Response:
    async with contextlib.aclosing(run.events()) as events:
        async for ev in events:
            if ev.error is not None:
                raise ev.error  # leaving the run cancels the other choices
            builder.add(ev.index, ev.resp)
    return web.json_response(builder.response())


async def _stream(request: web.Request, run, builder: ResponseBuilder) -> web.StreamResponse:
    state = request.app[STATE]
    async with contextlib.aclosing(run.events()) as events:
        # Wait for the first token before answering 200, so a failure before it is
        # still a proper HTTP error (after retries on other pairs).
        ev = await anext(events)
        if ev.error is not None:
            raise ev.error
        resp = sse.EventStream(headers={**sse.HEADERS, HEADER: request[REQUEST_ID]})
        await resp.prepare(request)
        # Events already waiting go out in one write (one send, not one per token):
        # a router behind its workers catches up instead of paying per event.
        pending: list[bytes] = []
        try:
            while True:
                if ev.error is not None:
                    state.metrics.stream_errors.inc()
                    request[REQUEST_LOG].warning("stream ended by an error: %s", ev.error.message)
                    pending.append(sse.event(ev.error.body()))
                    break
                pending.extend(sse.event(c) for c in builder.chunks(ev.index, ev.resp))
                if pending and not run.has_event():
                    await resp.write(b"".join(pending))
                    pending.clear()
                try:
                    ev = await anext(events)
                except StopAsyncIteration:
                    if builder.req.include_usage:
                        pending.append(sse.event(builder.usage_chunk()))
                    break
            pending.append(sse.DONE)
            await resp.write_eof(b"".join(pending))  # the last events and the end: one send
        except ConnectionResetError:
            request[REQUEST_LOG].info("client disconnected mid-stream; worker requests cancelled")
    return resp


def _model_card(state: RouterState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": state.registry.max_model_len(
            None if state.config.served_model_name else name
        ),
    }


def _model_names(state: RouterState) -> list[str]:
    served = state.config.served_model_name
    return [served] if served else state.registry.models()


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [_model_card(state, name) for name in _model_names(state)]
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: OpenAI's retrieve-model (the client's models.retrieve)."""
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in _model_names(state):
        raise _no_model(name)
    return web.json_response(_model_card(state, name))


async def version(request: web.Request) -> web.Response:
    try:
        v = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH
        v = "unknown"
    return web.json_response({"version": v})


async def _tokenizer_call(state: RouterState, model: str | None, method: str, pb):
    """A decode worker's Tokenize / Detokenize (the router holds no tokenizer); another
    worker of the model is tried when one is unavailable."""
    _, worker_model = resolve_model(state, model)
    error = None
    for worker in state.registry.healthy("decode", worker_model)[: state.config.max_retries + 1]:
        try:
            return await getattr(worker.stub, method)(pb, timeout=state.config.health_timeout * 5)
        except grpc.aio.AioRpcError as e:
            error = from_grpc(e.code(), e.details(), state.config.retry_after)
            if e.code() not in RETRYABLE:
                break
            state.registry.kick()
    raise error or unavailable("no healthy decode worker is available")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt or chat messages -> token ids."""
    state = request.app[STATE]
    body = await read_json(request, state.config.max_body_bytes)
    req = parse_tokenize_request(body, state.config.limits)
    pb = decode_pb2.TokenizeRequest(
        add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs
    )
    if req.prompt.messages is not None:
        pb.chat.CopyFrom(req.prompt.conversation_pb())
    else:
        pb.text = req.prompt.text
    resp = await _tokenizer_call(state, req.model, "Tokenize", pb)
    model, worker_model = resolve_model(state, req.model)
    body = {
        "count": len(resp.token_ids),
        "max_model_len": state.registry.max_model_len(worker_model),
        "tokens": list(resp.token_ids),
        "token_strs": list(resp.token_strs) if req.return_token_strs else None,
    }
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids -> text."""
    state = request.app[STATE]
    body = await read_json(request, state.config.max_body_bytes)
    model, ids = parse_detokenize_request(body, state.config.limits)
    pb = decode_pb2.DetokenizeRequest(token_ids=ids)
    resp = await _tokenizer_call(state, model, "Detokenize", pb)
    return web.json_response({"prompt": resp.text})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    registry = request.app[STATE].registry
    pairs = registry.usable_pairs()
    body = {
        "ready": bool(pairs),
        "healthy_prefill": len(registry.healthy("prefill")),
        "healthy_decode": len(registry.healthy("decode")),
        "pairs": len(pairs),
    }
    return web.json_response(body, status=200 if pairs else 503)


async def openapi_json(request: web.Request) -> web.Response:
    """The OpenAPI document: these routes, with the bodies and limits they accept."""
    return web.json_response(openapi.document(request.app, request.app[STATE].config.limits))


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    # expect: Expect headers other than 100-continue are ignored, not a text/plain 417
    add = {"expect_handler": expect_handler}
    app.router.add_post("/v1/chat/completions", chat_completions, **add)
    app.router.add_post("/v1/completions", completions, **add)
    app.router.add_get("/v1/models", models, **add)
    app.router.add_get("/v1/models/{model}", model, **add)
    app.router.add_post("/tokenize", tokenize, **add)
    app.router.add_post("/detokenize", detokenize, **add)
    app.router.add_get("/version", version, **add)
    app.router.add_get("/health", health, **add)
    app.router.add_get("/ready", ready, **add)
    app.router.add_get("/metrics", metrics, **add)
    app.router.add_get("/openapi.json", openapi_json, **add)
