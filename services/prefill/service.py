"""PrefillService: compute a prompt's KV, push it into the decode worker's blocks,
answer with the first token. Nothing stays allocated after the answer (full blocks
remain as prefix cache)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvtransfer import KVAgentInfo, KVTransferError, TransferStats
from kvtransfer.faults import PrefillStalls
from pdpb.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common import convert
from services.common.errors import (
    EngineFailedError,
    RequestAbortedError,
    RequestExistsError,
    UnknownPeerError,
)
from services.common.server import WorkerContext, load_report
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


@dataclass
class _InFlight:
    """A Prefill call in flight: its handler's task, and `done` once it has let go of
    every block, the KV transfer included."""

    task: asyncio.Task
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False  # cancelled by Abort(), not by its caller going away


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._inflight: dict[str, _InFlight] = {}
        # ids aborted before their Prefill arrived: refuse them when they do
        self._aborted: dict[str, float] = {}
        self._stalls = PrefillStalls.from_env()  # faults for tests only (kvtransfer/faults.py)
        if self._stalls.active:
            log.warning("prefill stall injection is on: %s", self._stalls)

    async def Handshake(self, request, context):
        peer = convert.agent_from_pb(request.decode_agent)
        ranks = [convert.agent_from_pb(a) for a in request.decode_rank_agents]
        kv = self.ctx.connector
        kv.add_peer(peer, ranks)  # KVLayoutMismatch: FAILED_PRECONDITION
        return prefill_pb2.HandshakeResponse(
            prefill_agent=convert.agent_to_pb(kv.agent_info()),
            model=self.ctx.engine_config.model,
            prefill_rank_agents=[convert.agent_to_pb(a) for a in kv.rank_agents],
        )

    async def Prefill(self, request, context):
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_params_from_pb(request.sampling_params)
        peer = self._admissible(rid, prompt, request)
        # in flight from here: a duplicate id is refused and Abort finds the call, also
        # while its grammar compiles
        call = self._inflight[rid] = _InFlight(asyncio.current_task())
        try:
            await self._validate(prompt, params)
            first, first_lp, prompt_lps, stats, prefill_s = await self._prefill_and_push(
                rid, prompt, params, peer, list(request.block_ids), request.num_cached_tokens
            )
        except KVTransferError:
            self.ctx.metrics.requests.labels("transfer_failed").inc()
            raise
        except asyncio.CancelledError:
            if not call.aborted:
                raise  # the caller went away: nobody to answer
            # Abort() stopped a call whose caller still waits: answer it (CANCELLED),
            # or it would wait out its deadline; gRPC sends no status for a handler
            # that ends cancelled
            call.task.uncancel()
            raise RequestAbortedError(f"prefill of {rid} was aborted by Abort()") from None
        finally:
            self._inflight.pop(rid, None)
            call.done.set()
        self.ctx.metrics.requests.labels("ok").inc()
        resp = prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=first,
            num_blocks_sent=stats.num_blocks,
            bytes_sent=stats.bytes,
            prefill_seconds=prefill_s,
            transfer_seconds=stats.seconds,
        )
        if params.logprobs is not None:
            resp.first_logprob.CopyFrom(convert.logprob_to_pb(first, first_lp, params.logprobs))
        if params.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                convert.prompt_logprobs_to_pb(prompt, prompt_lps, params.prompt_logprobs)
            )
        return resp

    def _admissible(self, rid, prompt, request) -> KVAgentInfo:
        """Checks a Prefill call before anything is allocated (but the sampling
        parameters: _validate); returns the peer."""
        engine = self.ctx.engine
        if not rid:
            raise ValueError("request_id is required")
        if rid in self._inflight:
            raise RequestExistsError(f"request {rid} is in flight")
        self._expire_aborted()
        if rid in self._aborted:
            raise RequestAbortedError(f"request {rid} was aborted")
        peer = next(
            (p for p in self.ctx.connector.peers() if p.session_id == request.decode_session_id),
            None,
        )
        if peer is None:
            raise UnknownPeerError(
                f"unknown decode session {request.decode_session_id!r}: call Handshake first"
            )
        engine.tokenize(prompt)
        block_size = self.ctx.engine_config.block_size
        if len(request.block_ids) != -(-len(prompt) // block_size):
            raise ValueError(
                f"{len(request.block_ids)} destination blocks for {len(prompt)} prompt tokens "
                f"(block size {block_size})"
            )
        return peer

    async def _validate(self, prompt, params) -> None:
        """ValueError (INVALID_ARGUMENT) for a request the engine cannot run; max_tokens
        is the decode worker's concern."""
        engine = self.ctx.engine
        if params.structured_output is None:
            engine.validate(prompt, params)
        else:  # compiling its grammar can take seconds: not on the loop every call uses
            await asyncio.to_thread(engine.validate, prompt, params)

    async def _prefill_and_push(self, rid, prompt, params, peer, block_ids, num_cached_tokens):
        """Computes the prompt, writes the blocks the decode worker lacks, frees ours
        (full blocks stay as prefix cache). Returns only once nothing can still write."""
        engine, loop = self.ctx.engine, self.ctx.loop
        if stall := self._stalls.stall("before", rid):
            await asyncio.sleep(stall)
        stream = loop.open_stream(rid)
        started = time.perf_counter()
        try:
            await loop.add_request(rid, prompt, params)
            out = await stream.get()
            if isinstance(out, asyncio.CancelledError):
                raise RequestAbortedError(f"prefill of {rid} was aborted")
            if isinstance(out, BaseException):
                raise EngineFailedError(f"prefill of {rid} failed: {out}") from out
            prefill_s = time.perf_counter() - started
            seq = engine.get_sequence(rid)
            if stall := self._stalls.stall("after", rid):
                await asyncio.sleep(stall)
            skip = num_cached_tokens // self.ctx.engine_config.block_size
            stats = await self._transfer(peer, seq.block_table[skip:], block_ids[skip:])
            first = out.output.token_ids[0]
            first_lp = out.output.logprobs[0] if params.logprobs is not None else None
            return first, first_lp, out.prompt_logprobs, stats, prefill_s
        finally:
            loop.close_stream(rid)
            await loop.free_request(rid)

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
        rid = request.request_id
        call = self._inflight.get(rid)
        if call is None:
            self._aborted[rid] = time.monotonic()
            return common_pb2.AbortResponse(found=False)
        call.aborted = True
        # the handler aborts the engine request; a write in flight finishes
        call.task.cancel()
        await asyncio.wait_for(call.done.wait(), self.ctx.settings.abort_timeout_s)
        return common_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        return await load_report(self.ctx, common_pb2.ROLE_PREFILL)

    def _expire_aborted(self) -> None:
        now = time.monotonic()
        for rid, t in list(self._aborted.items()):
            if now - t > _ABORTED_TTL_S:
                del self._aborted[rid]
