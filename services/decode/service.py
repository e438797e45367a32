"""DecodeService: the router's entry point for a request.

Generate: tokenize, reserve KV blocks (after a local prefix-cache lookup), ask the
chosen prefill worker to fill them through the transfer engine (or prefill locally),
then stream tokens. A failed or timed-out remote prefill is recomputed locally
(policy `recompute`) or reported (policy `fail`)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common import convert
from services.common.server import WorkerContext, load_report, require_ready
from services.engine import NoFreeBlocksError, RequestOutput

log = logging.getLogger(__name__)


class PrefillPeers:
    """One channel per prefill worker for the worker's lifetime, handshaken once."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return prefill_pb2_grpc.PrefillServiceStub(self._channels[address])

    async def session(self, address: str, timeout: float) -> str:
        """Handshake (once) and return our session id as the prefill worker knows it."""
        if address in self._sessions:
            return self._sessions[address]
        async with self._locks.setdefault(address, asyncio.Lock()):
            if address not in self._sessions:
                me = convert.agent_to_pb(self.ctx.connector.agent_info())
                resp = await self.stub(address).Handshake(
                    prefill_pb2.HandshakeRequest(decode_agent=me), timeout=timeout
                )
                peer = convert.agent_from_pb(resp.prefill_agent)
                self.ctx.connector.add_peer(peer)  # raises KVLayoutMismatch if incompatible
                self._sessions[address] = me.session_id
        return self._sessions[address]

    def forget(self, address: str) -> None:
        # after a failure the peer may have restarted with a new session: handshake again
        self._sessions.pop(address, None)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.peers = PrefillPeers(ctx)

    async def AddPrefillPeer(self, request, context):
        await require_ready(self.ctx, context)
        try:
            session = await self.peers.session(
                request.prefill_address, self.ctx.settings.prefill_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(
                e.code(), f"handshake with {request.prefill_address} failed: {e.details()}"
            )
        except ValueError as e:  # KVLayoutMismatch is a ValueError
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"prefill worker {request.prefill_address} is incompatible: {e}",
            )
        return decode_pb2.AddPrefillPeerResponse(session_id=session)

    async def GetLoad(self, request, context):
        await require_ready(self.ctx, context)
        return load_report(self.ctx, common_pb2.ROLE_DECODE)

    async def Abort(self, request, context):
        await require_ready(self.ctx, context)
        rid = request.request_id
        found = await self.ctx.loop.call(lambda: self.ctx.engine.abort_request(rid))
        if found:
            self.ctx.loop.publish_error(rid, asyncio.CancelledError("aborted by Abort()"))
        return common_pb2.AbortResponse(found=found)

    async def Generate(self, request, context):
        await require_ready(self.ctx, context)
        ctx, engine, loop = self.ctx, self.ctx.engine, self.ctx.loop
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = convert.sampling_params_from_pb(request.sampling_params)
            prompt_ids = self._prompt_ids(request)
            engine.validate(prompt_ids, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if (
            params.max_tokens is not None
            and len(prompt_ids) + params.max_tokens > engine.max_model_len
        ):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this model's maximum context length is {engine.max_model_len} tokens; the "
                f"prompt has {len(prompt_ids)} and max_tokens is {params.max_tokens}",
            )
        if rid in engine.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is in flight")

        started = time.perf_counter()
        timings = decode_pb2.Timings()
        stream = loop.open_stream(rid)
        try:
            if request.prefill_address:
                await self._remote_prefill(request, rid, prompt_ids, params, timings, context)
            else:
                await loop.call(lambda: engine.add_request(rid, prompt_ids, params))
            first = True
            sent_tokens = sent_chars = 0
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    if isinstance(out, asyncio.CancelledError):
                        yield self._final_abort(rid, prompt_ids, sent_tokens)
                        return
                    await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {out}")
                if first:
                    timings.first_token_seconds = time.perf_counter() - started
                resp = self._response(out, sent_tokens, sent_chars, params)
                if first and request.return_prompt:
                    resp.prompt_token_ids.extend(prompt_ids)
                    if request.HasField("text"):
                        resp.prompt_text = request.text
                    elif engine.tokenizer is not None:
                        resp.prompt_text = engine.tokenizer.decode(prompt_ids)
                first = False
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
                    resp.timings.CopyFrom(timings)
                    ctx.metrics.requests.labels("ok").inc()
                    yield resp
                    return
                yield resp
        finally:
            loop.close_stream(rid)
            # cancelled, failed or finished: make sure nothing stays allocated
            await loop.call_always(lambda: engine.abort_request(rid))

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
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ValueError("messages must not be empty")
            try:
                ids = engine.tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True
                )
            except Exception as e:  # template errors (bad roles, order) are the caller's
                raise ValueError(f"cannot apply the chat template: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        raise ValueError("a prompt (text, token_ids or chat) is required")

    async def _remote_prefill(self, request, rid, prompt_ids, params, timings, context):
        ctx, engine, loop = self.ctx, self.ctx.engine, self.ctx.loop
        settings = ctx.settings
        address = request.prefill_address
        reservation = await self._reserve(rid, prompt_ids, params, context)
        t0 = time.perf_counter()
        try:
            session = await self.peers.session(address, settings.prefill_timeout_s)
            call = self.peers.stub(address).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt_ids,
                    sampling_params=request.sampling_params,
                    decode_session_id=session,
                    block_ids=reservation.block_ids,
                    num_cached_tokens=reservation.num_cached_tokens,
                ),
                timeout=settings.prefill_timeout_s,
                metadata=(("x-request-id", rid),),
            )
            resp = await call
        except asyncio.CancelledError:
            # The client is gone: stop the prefill worker writing into our blocks before
            # they are freed (the caller's finally frees them).
            await self._abort_remote(address, rid)
            raise
        except (grpc.aio.AioRpcError, ValueError) as e:
            detail = (
                f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            )
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.details())
            self.peers.forget(address)
            policy = settings.prefill_failure_policy
            ctx.metrics.count_fallback(policy)
            log.warning(
                "request %s: prefill on %s failed (%s); policy %s", rid, address, detail, policy
            )
            # Either way the prefill worker may still be writing into the reserved
            # blocks: stop it, and wait until no write can land, before they are
            # recomputed here or freed by the caller's finally.
            await self._abort_remote(address, rid)
            if policy == "fail":
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"prefill worker {address} failed: {detail}"
                )
            timings.prefill_fallback = True
            await loop.call(lambda: engine.prefill_locally(rid))
            return
        timings.prefill_seconds = resp.prefill_seconds
        timings.kv_transfer_seconds = resp.transfer_seconds
        timings.queue_seconds = max(
            0.0, time.perf_counter() - t0 - resp.prefill_seconds - resp.transfer_seconds
        )
        first_lp = None
        if params.logprobs is not None and resp.HasField("first_logprob"):
            first_lp = convert.logprob_from_pb(resp.first_logprob, params.logprobs)
        out = await loop.call(lambda: engine.admit_remote(rid, resp.first_token_id, first_lp))
        loop.publish(out)

    async def _reserve(self, rid, prompt_ids, params, context):
        engine, loop = self.ctx.engine, self.ctx.loop
        deadline = time.monotonic() + self.ctx.settings.reserve_timeout_s
        while True:
            try:
                return await loop.call(lambda: engine.reserve_remote_kv(rid, prompt_ids, params))
            except NoFreeBlocksError as e:
                if time.monotonic() > deadline:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"no KV blocks free for this request: {e}",
                    )
                await asyncio.sleep(0.05)

    async def _abort_remote(self, address: str, rid: str) -> None:
        """Returns once the prefill worker can no longer write into rid's blocks."""
        try:
            await self.peers.stub(address).Abort(
                common_pb2.AbortRequest(request_id=rid), timeout=self.ctx.settings.abort_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # gone (or refusing calls): a dead prefill worker writes nothing more
                log.info("request %s: abort on %s: %s", rid, address, e.code().name)
                return
            # alive but not confirming: counted, so a stuck peer does not go unseen
            self.ctx.metrics.count_unconfirmed_abort()
            log.warning(
                "request %s: abort on %s not confirmed (%s: %s); its blocks are reused anyway",
                rid,
                address,
                e.code().name,
                e.details(),
            )

    def _response(self, out: RequestOutput, sent_tokens: int, sent_chars: int, params):
        completion = out.output
        new_ids = completion.token_ids[sent_tokens:]
        resp = decode_pb2.GenerateResponse(
            request_id=out.request_id, token_ids=new_ids, text=completion.text[sent_chars:]
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
