"""DecodeService: the router's entry point for a request, read as its lifecycle:
validate, claim an id of our own, get the prompt's KV (from a prefill worker, see
remote_prefill.py, or by prefilling here), stream the tokens, free everything.

Errors are raised as the domain's exceptions; services/common/interceptor.py turns
them into gRPC status codes."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common import convert
from services.common.errors import EngineFailedError, RequestExistsError
from services.common.server import WorkerContext, load_report
from services.decode.remote_prefill import PrefillPeers, PrefillTimings, RemotePrefill
from services.engine import RequestOutput, apply_chat_template

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
        self._instance = uuid.uuid4().hex[:8]
        self._serial = itertools.count()

    def claim(self, request_id: str) -> str:
        if request_id in self._keys:
            raise RequestExistsError(f"request {request_id} is in flight")
        key = self._keys[request_id] = f"{request_id}@{self._instance}.{next(self._serial)}"
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

    async def AddPrefillPeer(self, request, context):
        session = await self.peers.session(
            request.prefill_address, self.ctx.settings.prefill_timeout_s
        )
        return decode_pb2.AddPrefillPeerResponse(session_id=session)

    async def GetLoad(self, request, context):
        return await load_report(self.ctx, common_pb2.ROLE_DECODE)

    async def Abort(self, request, context):
        key = self.active.key_of(request.request_id)
        found = key is not None and await self.ctx.loop.call(
            lambda: self.ctx.engine.abort_request(key)
        )
        if found:
            self.ctx.loop.publish_error(key, asyncio.CancelledError("aborted by Abort()"))
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request, context):
        engine, loop = self.ctx.engine, self.ctx.loop
        rid = request.request_id
        if not rid:
            raise ValueError("request_id is required")
        params = convert.sampling_params_from_pb(request.sampling_params)
        prompt_ids = engine.truncate(self._prompt_ids(request), params)
        engine.validate(prompt_ids, params, fit_max_tokens=True)
        key = self.active.claim(rid)
        stream = loop.open_stream(key)
        try:
            if request.prefill_address:
                timings = await self.remote_prefill.run(
                    key,
                    prompt_ids,
                    params,
                    request.sampling_params,
                    request.prefill_address,
                    trace_id=rid,
                )
            else:
                timings = PrefillTimings()
                await loop.call(lambda: engine.add_request(key, prompt_ids, params))
            async for resp in self._responses(stream, rid, request, prompt_ids, params, timings):
                yield resp
        finally:
            loop.close_stream(key)
            self.active.release(rid, key)
            # cancelled, failed or finished: make sure nothing stays allocated
            await loop.call_always(lambda: engine.abort_request(key))

    async def _responses(self, stream, rid, request, prompt_ids, params, timings):
        sent_tokens = sent_chars = 0
        while True:
            out = await stream.get()
            if isinstance(out, asyncio.CancelledError):  # Abort()
                yield self._final_abort(rid, prompt_ids, sent_tokens)
                return
            if isinstance(out, BaseException):
                raise EngineFailedError(f"engine failed: {out}") from out
            resp = self._response(rid, out, sent_tokens, sent_chars, params)
            if sent_tokens == 0 and request.return_prompt:
                self._add_prompt(resp, request, prompt_ids)
            if sent_tokens == 0 and out.prompt_logprobs is not None:
                self._add_prompt_logprobs(resp, prompt_ids, out, params)
            sent_tokens = len(out.output.token_ids)
            sent_chars += len(resp.text)
            if out.finished:
                resp.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=len(prompt_ids),
                        completion_tokens=sent_tokens,
                        cached_tokens=out.num_cached_tokens,
                    )
                )
                resp.timings.CopyFrom(convert.timings_to_pb(timings))
                self.ctx.metrics.requests.labels("ok").inc()
                yield resp
                return
            yield resp

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

    def _add_prompt(self, resp, request, prompt_ids) -> None:
        resp.prompt_token_ids.extend(prompt_ids)
        if request.HasField("text"):
            resp.prompt_text = request.text
        elif self.ctx.engine.tokenizer is not None:
            resp.prompt_text = self.ctx.engine.tokenizer.decode(prompt_ids)

    def _add_prompt_logprobs(self, resp, prompt_ids, out: RequestOutput, params) -> None:
        # the first prompt token has no logprob (rank 0); its text is still needed (echo)
        first = self.ctx.engine.decode_token(prompt_ids[0]) or ""
        resp.prompt_logprobs.append(
            common_pb2.TokenLogprob(token_id=prompt_ids[0], rank=0, token=first)
        )
        resp.prompt_logprobs.extend(
            convert.prompt_logprobs_to_pb(prompt_ids, out.prompt_logprobs, params.prompt_logprobs)
        )

    def _response(self, rid, out: RequestOutput, sent_tokens: int, sent_chars: int, params):
        completion = out.output
        new_ids = completion.token_ids[sent_tokens:]
        resp = decode_pb2.GenerateResponse(
            request_id=rid, token_ids=new_ids, text=completion.text[sent_chars:]
        )
        if params.logprobs is not None and completion.logprobs:
            for tid, entry in zip(new_ids, completion.logprobs[sent_tokens:]):
                resp.logprobs.append(convert.logprob_to_pb(tid, entry, params.logprobs))
        if out.finished:
            resp.finish_reason = convert.finish_reason_to_pb(completion.finish_reason)
            if isinstance(completion.stop_reason, int):
                resp.stop_token_id = completion.stop_reason
            elif isinstance(completion.stop_reason, str):
                resp.stop_string = completion.stop_reason
        return resp

    def _final_abort(self, rid, prompt_ids, sent_tokens):
        return decode_pb2.GenerateResponse(
            request_id=rid,
            finish_reason=common_pb2.FINISH_REASON_ABORT,
            usage=common_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=sent_tokens),
        )
