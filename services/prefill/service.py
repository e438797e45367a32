"""PrefillService: compute a prompt's KV, push it into the decode worker's blocks,
answer with the first token. Nothing stays allocated after the answer (full blocks
remain as prefix cache)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer import KVAgentInfo, KVLayoutMismatch, KVTransferError, TransferStats
from pdpb.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common import convert
from services.common.server import WorkerContext, load_report, require_ready
from services.common.settings import ABANDONED_WRITE_WAIT_S

log = logging.getLogger(__name__)
_ABORTED_TTL_S = 300.0


async def _uncancellable(task: asyncio.Future):
    """Await task to its end through any number of cancellations, then re-raise the
    first cancellation (if any): for work that must finish before we let go."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise  # the task itself was cancelled
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        # request id -> (its handler task, set once the handler has let go of every block,
        # the KV transfer included)
        self._inflight: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}
        # ids aborted before their Prefill arrived: refuse them when they do
        self._aborted: dict[str, float] = {}

    async def Handshake(self, request, context):
        await require_ready(self.ctx, context)
        try:
            peer = convert.agent_from_pb(request.decode_agent)
            self.ctx.connector.add_peer(peer)
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible KV layout: {e}")
        except (ValueError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad decode agent info: {e}")
        return prefill_pb2.HandshakeResponse(
            prefill_agent=convert.agent_to_pb(self.ctx.connector.agent_info()),
            model=self.ctx.engine_config.model,
        )

    async def Prefill(self, request, context):
        await require_ready(self.ctx, context)
        rid = request.request_id
        engine, loop = self.ctx.engine, self.ctx.loop
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if rid in self._inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is in flight")
        self._expire_aborted()
        if rid in self._aborted:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        peer = next(
            (p for p in self.ctx.connector.peers() if p.session_id == request.decode_session_id),
            None,
        )
        if peer is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"unknown decode session {request.decode_session_id!r}: call Handshake first",
            )
        prompt = list(request.prompt_token_ids)
        try:
            params = convert.sampling_params_from_pb(request.sampling_params)
            engine.tokenize(prompt)
            engine.validate(prompt, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        block_size = self.ctx.engine_config.block_size
        if len(request.block_ids) != -(-len(prompt) // block_size):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.block_ids)} destination blocks for {len(prompt)} prompt tokens "
                f"(block size {block_size})",
            )

        done = asyncio.Event()
        self._inflight[rid] = (asyncio.current_task(), done)
        stream = loop.open_stream(rid)
        started = time.perf_counter()
        try:
            await loop.call(lambda: engine.add_request(rid, prompt, params))
            out = await stream.get()
            if isinstance(out, BaseException):
                aborted = isinstance(out, asyncio.CancelledError)
                await context.abort(
                    grpc.StatusCode.CANCELLED if aborted else grpc.StatusCode.INTERNAL,
                    f"prefill of {rid} {'was aborted' if aborted else f'failed: {out}'}",
                )
            prefill_s = time.perf_counter() - started
            seq = engine.get_sequence(rid)
            skip = request.num_cached_tokens // block_size
            src, dst = seq.block_table[skip:], list(request.block_ids)[skip:]
            stats = await self._transfer(peer, src, dst)
            first = out.output.token_ids[0]
            resp = prefill_pb2.PrefillResponse(
                request_id=rid,
                first_token_id=first,
                num_blocks_sent=len(src),
                bytes_sent=stats.bytes,
                prefill_seconds=prefill_s,
                transfer_seconds=stats.seconds,
            )
            if params.logprobs is not None:
                resp.first_logprob.CopyFrom(
                    convert.logprob_to_pb(first, out.output.logprobs[0], params.logprobs)
                )
            self.ctx.metrics.requests.labels("ok").inc()
            return resp
        except KVTransferError as e:
            self.ctx.metrics.requests.labels("transfer_failed").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        finally:
            loop.close_stream(rid)
            try:
                await loop.call_always(lambda: engine.release(rid) or engine.abort_request(rid))
            finally:
                self._inflight.pop(rid, None)
                done.set()

    async def _transfer(self, peer: KVAgentInfo, src: list[int], dst: list[int]):
        metrics = self.ctx.metrics
        timeout = self.ctx.settings.kv_transfer_timeout_s
        pause = self.ctx.settings.fault_pause_mid_transfer_s
        try:
            if pause > 0 and len(src) > 1:
                half = len(src) // 2
                first = await self._write(peer, src[:half], dst[:half], timeout)
                log.warning("fault injection: pausing %.1fs mid-transfer", pause)
                await asyncio.sleep(pause)
                rest = await self._write(peer, src[half:], dst[half:], timeout)
                stats = TransferStats(
                    first.bytes + rest.bytes,
                    len(src),
                    first.num_regions + rest.num_regions,
                    first.num_batches + rest.num_batches,
                    first.seconds + rest.seconds,
                )
            else:
                stats = await self._write(peer, src, dst, timeout)
        except KVTransferError:
            metrics.kv_transfers.labels("failed").inc()
            raise
        metrics.kv_transfers.labels("ok").inc()
        metrics.kv_transfer_bytes.inc(stats.bytes)
        metrics.kv_transfer_seconds.observe(stats.seconds)
        return stats

    async def _write(self, peer, src, dst, timeout):
        """Returns, or raises, only once this write can no longer change the decode
        worker's blocks: the decode worker reuses them as soon as we answer or Abort
        returns."""
        task = asyncio.ensure_future(
            asyncio.to_thread(self.ctx.connector.write_blocks, peer, src, dst, timeout)
        )
        try:
            return await _uncancellable(task)
        finally:
            # A write past its deadline was walked away from, but the engine call may
            # still be writing: wait for it too (Mooncake gives up on its own).
            exc = task.exception() if task.done() and not task.cancelled() else None
            if isinstance(exc, KVTransferError) and exc.in_flight is not None:
                await _uncancellable(
                    asyncio.ensure_future(
                        asyncio.to_thread(exc.in_flight.wait, ABANDONED_WRITE_WAIT_S)
                    )
                )
                if not exc.in_flight.is_set():
                    self.ctx.metrics.requests.labels("write_still_running").inc()
                    log.error(
                        "an abandoned KV write to %s is still running after %.0fs",
                        peer.session_id,
                        ABANDONED_WRITE_WAIT_S,
                    )

    async def Abort(self, request, context):
        """Returns once nothing of the request can still write to the decode worker."""
        await require_ready(self.ctx, context)
        rid = request.request_id
        entry = self._inflight.get(rid)
        if entry is None:
            self._aborted[rid] = time.monotonic()
            return common_pb2.AbortResponse(found=False)
        task, done = entry
        task.cancel()  # the handler aborts the engine request; a write in flight finishes
        await asyncio.wait_for(done.wait(), self.ctx.settings.abort_timeout_s)
        return common_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        await require_ready(self.ctx, context)
        return load_report(self.ctx, common_pb2.ROLE_PREFILL)

    def _expire_aborted(self) -> None:
        now = time.monotonic()
        for rid, t in list(self._aborted.items()):
            if now - t > _ABORTED_TTL_S:
                del self._aborted[rid]
