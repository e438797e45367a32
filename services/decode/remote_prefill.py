"""Remote prefill, seen from the decode worker: reserve the blocks, have a prefill
worker fill them through the transfer engine, and on failure apply the policy
(`recompute` here, or `fail`), always stopping the prefill worker's writes first.

The decode worker's side of the request walk in docs/architecture.md."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvtransfer import KVLayoutMismatch, KVTransferError
from pdpb import tls
from pdpb.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common import convert
from services.common.errors import PeerFailedError
from services.common.server import WorkerContext
from services.engine import NoFreeBlocksError, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class PrefillTimings:
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    kv_transfer_seconds: float = 0.0
    prefill_fallback: bool = False  # computed here after the remote prefill failed


class PrefillPeers:
    """One channel per prefill worker for the worker's lifetime, handshaken once."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        s = ctx.settings
        # a TLS decode worker calls prefill workers over TLS too, presenting its client
        # identity for their mutual TLS
        self._credentials = (
            tls.channel_credentials(s.tls_ca_file, *s.tls_client_pair) if s.tls else None
        )

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        if address not in self._channels:
            self._channels[address] = tls.aio_channel(
                address, self._credentials, self.ctx.settings.tls_server_name
            )
        return prefill_pb2_grpc.PrefillServiceStub(self._channels[address])

    async def session(self, address: str, timeout: float) -> str:
        """Handshake (once) and return our session id as the prefill worker knows it.
        Raises KVLayoutMismatch for an incompatible peer, PeerFailedError for one that
        does not answer."""
        if address in self._sessions:
            return self._sessions[address]
        async with self._locks.setdefault(address, asyncio.Lock()):
            if address not in self._sessions:
                kv = self.ctx.connector
                me = convert.agent_to_pb(kv.agent_info())
                ranks = [convert.agent_to_pb(a) for a in kv.rank_agents]
                request = prefill_pb2.HandshakeRequest(decode_agent=me, decode_rank_agents=ranks)
                try:
                    resp = await self.stub(address).Handshake(request, timeout=timeout)
                except grpc.aio.AioRpcError as e:
                    raise _peer_error(address, "handshake", e) from None
                peer = convert.agent_from_pb(resp.prefill_agent)
                peer_ranks = [convert.agent_from_pb(a) for a in resp.prefill_rank_agents]
                await self.ctx.add_kv_peer(peer, peer_ranks)  # KVLayoutMismatch if not
                self._sessions[address] = me.session_id
        return self._sessions[address]

    def forget(self, address: str) -> None:
        # after a failure the peer may have restarted with a new session: handshake again
        self._sessions.pop(address, None)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class RemotePrefill:
    def __init__(self, ctx: WorkerContext, peers: PrefillPeers):
        self.ctx = ctx
        self.peers = peers

    async def run(
        self,
        key: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sampling_pb: common_pb2.SamplingParams,
        address: str,
        trace_id: str,
    ) -> PrefillTimings:
        """Fill request `key`'s KV from the prefill worker at `address` and admit it for
        decoding (or prefill it here). Its first output is published on the request's
        stream. Raises PeerFailedError under policy `fail`."""
        ctx = self.ctx
        settings = ctx.settings
        reservation = await self._reserve(key, prompt_ids, params)
        t0 = time.perf_counter()
        try:
            session = await self.peers.session(address, settings.prefill_timeout_s)
            resp = await self.peers.stub(address).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=key,
                    prompt_token_ids=prompt_ids,
                    sampling_params=sampling_pb,
                    decode_session_id=session,
                    block_ids=reservation.block_ids,
                    num_cached_tokens=reservation.num_cached_tokens,
                ),
                timeout=settings.prefill_timeout_s,
                metadata=(("x-request-id", trace_id),),
            )
        except asyncio.CancelledError:
            # The client is gone: stop the prefill worker writing into our blocks before
            # they are freed (the caller frees them).
            await self._abort_remote(address, key)
            raise
        except KVLayoutMismatch:
            # The handshake refused the pair (before any write): that never heals, and
            # recomputing every request here would hide the misconfiguration. The
            # caller frees the reserved blocks; the client gets FAILED_PRECONDITION.
            raise
        except (grpc.aio.AioRpcError, PeerFailedError, KVTransferError, ValueError) as e:
            # KVTransferError: our side of the handshake with it failed (a transient
            # transfer-engine fault), which the policy handles like any peer failure
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None  # the request is bad, not the peer
            return await self._fall_back(key, address, e)
        timings = PrefillTimings(
            prefill_seconds=resp.prefill_seconds,
            kv_transfer_seconds=resp.transfer_seconds,
            queue_seconds=max(
                0.0, time.perf_counter() - t0 - resp.prefill_seconds - resp.transfer_seconds
            ),
        )
        first_lp = None
        if params.logprobs is not None and resp.HasField("first_logprob"):
            first_lp = convert.logprob_from_pb(resp.first_logprob, params.logprobs)
        prompt_lps = None
        if params.prompt_logprobs is not None:
            n = params.prompt_logprobs
            prompt_lps = [convert.logprob_from_pb(lp, n) for lp in resp.prompt_logprobs]
        await ctx.loop.admit_remote(key, resp.first_token_id, first_lp, prompt_lps)
        return timings

    async def _fall_back(self, key: str, address: str, error: Exception) -> PrefillTimings:
        detail = (
            f"{error.code().name}: {error.details()}"
            if isinstance(error, grpc.aio.AioRpcError)
            else str(error)
        )
        self.peers.forget(address)
        policy = self.ctx.settings.prefill_failure_policy
        self.ctx.metrics.count_fallback(policy)
        log.warning(
            "request %s: prefill on %s failed (%s); policy %s", key, address, detail, policy
        )
        # Either way the prefill worker may still be writing into the reserved blocks:
        # stop it, and wait until no write can land, before they are recomputed here or
        # freed by the caller.
        await self._abort_remote(address, key)
        if policy == "fail":
            raise PeerFailedError(f"prefill worker {address} failed: {detail}")
        await self.ctx.loop.prefill_locally(key)
        return PrefillTimings(prefill_fallback=True)

    async def _reserve(self, key, prompt_ids, params):
        deadline = time.monotonic() + self.ctx.settings.reserve_timeout_s
        while True:
            try:
                return await self.ctx.loop.reserve_remote_kv(key, prompt_ids, params)
            except NoFreeBlocksError as e:
                if time.monotonic() > deadline:
                    raise NoFreeBlocksError(f"no KV blocks free for this request: {e}") from None
                await asyncio.sleep(0.05)

    async def _abort_remote(self, address: str, key: str) -> None:
        """Returns once the prefill worker can no longer write into key's blocks."""
        try:
            await self.peers.stub(address).Abort(
                common_pb2.AbortRequest(request_id=key), timeout=self.ctx.settings.abort_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # gone (or refusing calls): a dead prefill worker writes nothing more
                log.info("request %s: abort on %s: %s", key, address, e.code().name)
                return
            # alive but not confirming: counted, so a stuck peer does not go unseen
            self.ctx.metrics.count_unconfirmed_abort()
            log.warning(
                "request %s: abort on %s not confirmed (%s: %s); its blocks are reused anyway",
                key,
                address,
                e.code().name,
                e.details(),
            )


def _peer_error(address: str, what: str, e: grpc.aio.AioRpcError) -> Exception:
    detail = f"{what} with {address} failed: {e.code().name}: {e.details()}"
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # it refused our layout
        return KVLayoutMismatch(f"prefill worker {address} is incompatible: {e.details()}")
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(detail)
    return PeerFailedError(detail)
