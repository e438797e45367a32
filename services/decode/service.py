"""DecodeService: the router's entry point for a request, read as its lifecycle:
validate, claim an id of our own, get the prompt's KV (from a prefill worker, see
remote_prefill.py, or by prefilling here), stream the tokens, free everything.

Errors are raised as the domain's exceptions; services/common/interceptor.py turns
them into gRPC status codes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common import convert
from services.common.errors import RequestExistsError
from services.common.server import WorkerContext, load_report
from services.decode.mux import (
    BATCH_METADATA,
    DELTAS_METADATA,
    MuxSession,
    Outbox,
    OutboxSink,
    serve_one,
)
from services.decode.remote_prefill import PrefillPeers, PrefillTimings, RemotePrefill
from services.decode.responses import ResponseBuilder
from services.engine import apply_chat_template

log = logging.getLogger(__name__)


def _chat_ids(tokenizer, chat, add_special_tokens: bool = False) -> list[int]:
    """A pdpb Conversation through the chat template, with its options."""
    kwargs = {}
    if chat.chat_template_kwargs_json:
        kwargs = json.loads(chat.chat_template_kwargs_json)
        if not isinstance(kwargs, dict):
            raise ValueError("chat_template_kwargs must be a JSON object")
    messages, tools = convert.chat_messages_from_pb(chat)
    return apply_chat_template(
        tokenizer,
        messages,
        add_special_tokens=add_special_tokens,
        template_kwargs=kwargs,
        tools=tools,
        add_generation_prompt=(
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        ),
        continue_final_message=chat.continue_final_message,
    )


class ActiveRequests:
    """The caller's request ids of the requests in flight, each mapped to a key this
    worker owns. Engine state, streams and remote prefills use the key, so two callers
    (two routers) that send one id cannot reach, replace or free each other's request;
    the second is refused while the first runs. Keys are unique across workers too: a
    prefill worker serving many decode workers sees no collisions."""

    def __init__(self):
        self._keys: dict[str, str] = {}
        self.instance = uuid.uuid4().hex[:8]
        self._serial = itertools.count()

    def claim(self, request_id: str) -> str:
        if request_id in self._keys:
            raise RequestExistsError(f"request {request_id} is in flight")
        key = self._keys[request_id] = f"{request_id}@{self.instance}.{next(self._serial)}"
        return key

    def release(self, request_id: str, key: str) -> None:
        if self._keys.get(request_id) == key:
            del self._keys[request_id]

    def key_of(self, request_id: str) -> str | None:
        return self._keys.get(request_id)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.peers = PrefillPeers(ctx)
        self.remote_prefill = RemotePrefill(ctx, self.peers)
        self.active = ActiveRequests()
        # prefill workers' logs name a request by its key: this line says whose it is
        log.info("this decode worker's request keys end in @%s.<n>", self.active.instance)
        self.sessions: set[MuxSession] = set()
        ctx.on_drain(self._drain_sessions)

    def _drain_sessions(self) -> None:
        for session in self.sessions:
            session.drain()

    async def AddPrefillPeer(self, request, context):
        session = await self.peers.session(
            request.prefill_address, self.ctx.settings.prefill_timeout_s
        )
        return decode_pb2.AddPrefillPeerResponse(session_id=session)

    async def GetLoad(self, request, context):
        return await load_report(self.ctx, common_pb2.ROLE_DECODE)

    async def Abort(self, request, context):
        key = self.active.key_of(request.request_id)
        found = key is not None and await self.ctx.loop.abort_request(key)
        if found:
            self.ctx.loop.publish_error(key, asyncio.CancelledError("aborted by Abort()"))
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request, context):
        """One request, its responses on their own stream: the lifecycle below."""
        # closed with the call, not when collected: its `finally` frees the request
        async with contextlib.aclosing(
            serve_one(self._generate_into, request, self.ctx.metrics.merged_responses.inc)
        ) as responses:
            async for response in responses:
                yield response

    async def GenerateStream(self, request_iterator, context):
        """Many requests over one stream, a message per engine step (mux.py)."""
        columns = DELTAS_METADATA in tuple(context.invocation_metadata() or ())
        session = MuxSession(self._generate_into, self.ctx.metrics.merged_responses.inc, columns)
        if self.ctx.draining:
            session.drain()
        self.sessions.add(session)
        try:
            await context.send_initial_metadata((BATCH_METADATA,))
            async with contextlib.aclosing(session.serve(request_iterator)) as messages:
                async for message in messages:
                    yield message
        finally:
            self.sessions.discard(session)

    async def _generate_into(self, request, outbox: Outbox) -> None:
        """A request's whole lifecycle, its responses written into an outbox (its own
        for Generate, the stream's for GenerateStream); its error is raised."""
        rid, params, prompt_ids = await self._checked(request)
        key = self.active.claim(rid)
        builder = ResponseBuilder(self.ctx.engine, rid, request, prompt_ids, params)
        sink = OutboxSink(builder, outbox)
        self.ctx.loop.open_stream(key, sink)
        try:
            builder.timings = await self._prefill(key, request, prompt_ids, params)
            sink.start()
            if await sink.done:
                self.ctx.metrics.requests.labels("ok").inc()
        finally:
            await self._end(rid, key)

    async def _checked(self, request) -> tuple[str, object, list[int]]:
        if not request.request_id:
            raise ValueError("request_id is required")
        engine = self.ctx.engine
        params = convert.sampling_params_from_pb(request.sampling_params)
        prompt_ids = engine.truncate(self._prompt_ids(request), params)
        if params.structured_output is None:
            engine.validate(prompt_ids, params, fit_max_tokens=True)
        else:  # compiling its grammar can take seconds: not on the loop every stream uses
            await asyncio.to_thread(engine.validate, prompt_ids, params, fit_max_tokens=True)
        return request.request_id, params, prompt_ids

    async def _prefill(self, key, request, prompt_ids, params) -> PrefillTimings:
        """The prompt's KV into this worker: from the named prefill worker, or here."""
        if request.prefill_address:
            return await self.remote_prefill.run(
                key,
                prompt_ids,
                params,
                request.sampling_params,
                request.prefill_address,
                trace_id=request.request_id,
            )
        await self.ctx.loop.add_request(key, prompt_ids, params)
        return PrefillTimings()

    async def _end(self, rid: str, key: str) -> None:
        # cancelled, failed or finished: make sure nothing stays allocated
        loop = self.ctx.loop
        loop.close_stream(key)
        self.active.release(rid, key)
        await loop.free_request(key)

    def _prompt_ids(self, request) -> list[int]:
        engine = self.ctx.engine
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return engine.tokenize(list(request.token_ids.ids))
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        if kind == "text":
            return engine.tokenize(request.text)
        if kind == "chat":
            return _chat_ids(engine.tokenizer, request.chat)
        raise ValueError("a prompt (text, token_ids or chat) is required")

    async def Tokenize(self, request, context):
        tokenizer = self.ctx.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer")
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        elif kind == "chat":
            ids = _chat_ids(tokenizer, request.chat, request.add_special_tokens)
        else:
            raise ValueError("a prompt (text or chat) is required")
        resp = decode_pb2.TokenizeResponse(token_ids=ids)
        if request.return_token_strs:
            resp.token_strs.extend(tokenizer.convert_ids_to_tokens(list(ids)))
        return resp

    async def Detokenize(self, request, context):
        engine = self.ctx.engine
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        ids = engine.tokenize(list(request.token_ids))  # range-checks the ids
        return decode_pb2.DetokenizeResponse(text=engine.tokenizer.decode(ids))
