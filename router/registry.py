"""The worker registry: which prefill and decode workers exist, which are healthy, and
which (decode, prefill) pairs have shaken hands.

Workers come from targets: the static command-line addresses, addresses added through
the admin endpoint, and DNS names standing for several workers (re-resolved every
`dns_interval`). One gRPC channel per worker lives as long as the worker is known.
A background loop probes every worker each `health_interval` through grpc.health.v1
and GetLoad (one failed probe takes a worker out, one good probe brings it back), and
pairs each healthy decode worker with each healthy prefill worker through
AddPrefillPeer; an incompatible pair is logged and never used.

A router given no prefill target at all (none on the command line, none added through
the admin endpoint) runs colocated: each healthy decode worker is paired with
LocalPrefill and prefills its own requests. With a prefill target, only shaken-hands
pairs are used, even while its DNS name resolves to no worker."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdpb import tls
from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.config import ROLES, RouterConfig, normalize_address
from router.discovery import is_literal, resolve
from router.mux import DecodeMux

log = logging.getLogger("pdserve.router.registry")

CHANNEL_OPTIONS = [
    # a restarted worker is found again within seconds, not after gRPC's 2-minute backoff
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
_ROLE_PB = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
_INCOMPATIBLE = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
)


class LocalPrefill:
    """The prefill side of a colocated pair: the decode worker prefills itself (an empty
    GenerateRequest.prefill_address means exactly that)."""

    role = "prefill"
    address = ""
    load = None

    def __init__(self):
        self.inflight = 0
        self.requests = 0


@dataclass
class Pairing:
    state: str  # "pending", "ok" or "incompatible"
    detail: str = ""


class Worker:
    def __init__(self, role: str, address: str, channel: grpc.aio.Channel):
        self.role = role
        self.address = address
        self.channel = channel
        self.health = health_pb2_grpc.HealthStub(channel)
        self.mux: DecodeMux | None = None  # decode: this router's requests share one stream
        if role == "decode":
            self.stub = decode_pb2_grpc.DecodeServiceStub(channel)
            self.mux = DecodeMux(self.stub)
        else:
            self.stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        self.healthy = False
        self.error = "not probed yet"
        self.load: common_pb2.LoadReport | None = None
        self.inflight = 0  # this router's requests on the worker now
        self.requests = 0  # this router's requests sent to the worker, ever
        self.peers: dict[str, Pairing] = {}  # decode workers: prefill address -> pairing
        self.slow_probes = 0  # health probes timed out in a row

    @property
    def model(self) -> str | None:
        return self.load.model if self.load is not None and self.load.model else None

    def describe(self) -> dict:
        load = self.load
        info = {
            "role": self.role,
            "address": self.address,
            "healthy": self.healthy,
            "error": None if self.healthy else self.error,
            "model": self.model,
            "inflight": self.inflight,
            "requests": self.requests,
        }
        if load is not None:
            info.update(
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_free_blocks=load.num_free_blocks,
                num_total_blocks=load.num_total_blocks,
                max_model_len=load.max_model_len,
                orphaned_kv_blocks=load.orphaned_kv_blocks,
                oldest_kv_reservation_seconds=load.oldest_kv_reservation_seconds,
            )
        if self.role == "decode":
            info["prefill_peers"] = {a: p.state for a, p in sorted(self.peers.items())}
        return info


@dataclass
class Target:
    origin: str  # "static", "admin"
    addresses: set[str] = field(default_factory=set)


class WorkerRegistry:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.targets: dict[tuple[str, str], Target] = {}
        self.workers: dict[tuple[str, str], Worker] = {}
        for role in ROLES:
            for spec in getattr(config, role):
                self.targets[(role, spec)] = Target("static")
        self.local_prefill = LocalPrefill()
        self._tasks: set[asyncio.Task] = set()
        self._closing: list[grpc.aio.Channel] = []
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Future | None = None
        self._kicked = False
        self._last_dns = float("-inf")
        self._credentials = config.worker_channel_credentials()  # None: plaintext

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for target in self.targets:
            self._resolve_literal(*target)
        self._sync_workers()
        self._loop_task = asyncio.create_task(self._run(), name="router-registry")

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channels = [w.channel for w in self.workers.values()] + self._closing
        muxes = [w.mux for w in self.workers.values() if w.mux is not None]
        await asyncio.gather(*(m.close() for m in muxes), return_exceptions=True)
        self.workers.clear()
        self._closing.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    def kick(self) -> None:
        """Probe now rather than at the next interval (a worker just failed a request)."""
        self._kicked = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _run(self) -> None:
        while True:
            try:
                if time.monotonic() - self._last_dns >= self.config.dns_interval:
                    await self.refresh_targets()
                await self.probe_all()
                self.pair_all()
            except Exception:  # never let a bug stop health checking
                log.exception("registry loop failed")
            if self._kicked:  # failing requests kick often: at most 10 rounds a second
                await asyncio.sleep(min(0.1, self.config.health_interval))
            else:
                await self._sleep(self.config.health_interval)
            self._kicked = False

    async def _sleep(self, seconds: float) -> None:
        """Sleep until the next round or a kick. (Not wait_for on an Event: on Python
        3.11 we saw close() hang when it cancelled that right after a kick set it.)"""
        loop = asyncio.get_running_loop()
        self._wakeup = fut = loop.create_future()
        handle = loop.call_later(seconds, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            handle.cancel()
            self._wakeup = None

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ targets

    def _resolve_literal(self, role: str, spec: str) -> None:
        if is_literal(spec):
            self.targets[(role, spec)].addresses = {spec}

    async def _resolve(self, role: str, spec: str) -> None:
        target = self.targets.get((role, spec))
        if target is None:
            return
        try:
            addresses = await resolve(spec)
        except OSError as e:
            # keep what we had: a DNS hiccup must not drop healthy workers
            log.warning("cannot resolve %s worker %s: %s", role, spec, e)
            return
        if addresses != target.addresses:
            log.info("%s worker %s resolves to %s", role, spec, sorted(addresses) or "nothing")
        target.addresses = addresses

    async def refresh_targets(self) -> None:
        self._last_dns = time.monotonic()
        await asyncio.gather(*(self._resolve(role, spec) for role, spec in list(self.targets)))
        self._sync_workers()

    async def add_target(self, role: str, spec: str, origin: str = "admin") -> list[str]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        spec = normalize_address(spec)
        if (role, spec) not in self.targets:
            self.targets[(role, spec)] = Target(origin)
            await self._resolve(role, spec)
            self._sync_workers()
            self.kick()
        return sorted(self.targets[(role, spec)].addresses)

    def remove_target(self, role: str, spec: str) -> bool:
        spec = normalize_address(spec)
        if self.targets.pop((role, spec), None) is None:
            return False
        self._sync_workers()
        return True

    def _sync_workers(self) -> None:
        wanted = {(role, a) for (role, _), t in self.targets.items() for a in t.addresses}
        for key in wanted - self.workers.keys():
            channel = tls.aio_channel(
                key[1], self._credentials, self.config.worker_tls_server_name, CHANNEL_OPTIONS
            )
            self.workers[key] = Worker(key[0], key[1], channel)
            log.info("%s worker %s added", *key)
        for key in self.workers.keys() - wanted:
            worker = self.workers.pop(key)
            worker.healthy = False
            if worker.role == "prefill":
                for d in self.of_role("decode"):
                    d.peers.pop(worker.address, None)
            log.info("%s worker %s removed", *key)
            # requests still running on it may finish before the channel closes
            self._closing.append(worker.channel)
            self._spawn(self._retire(worker))

    async def _retire(self, worker: Worker) -> None:
        """Close a removed worker's channel once this router's requests on it are done.

        (Not Channel.close(grace): a task cancelled inside it may never report done.)"""
        deadline = time.monotonic() + self.config.request_timeout
        while worker.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if worker.mux is not None:
            await worker.mux.close()
        if worker.channel in self._closing:
            self._closing.remove(worker.channel)
            await worker.channel.close()

    # ------------------------------------------------------------------ health

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    async def probe(self, worker: Worker) -> None:
        timeout = self.config.health_timeout
        ok, error = False, ""
        try:
            resp = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                error = "health: " + health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            else:
                load = await worker.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout)
                worker.load = load
                if load.role not in (common_pb2.ROLE_UNSPECIFIED, common_pb2.ROLE_BOTH) and (
                    load.role != _ROLE_PB[worker.role]
                ):
                    error = (
                        f"it reports role {common_pb2.Role.Name(load.role)} but is registered "
                        f"as a {worker.role} worker"
                    )
                else:
                    ok = True
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.healthy:
                # alive but busy (its engine holding the GIL, a loaded host): give it
                # a few probes before taking it out of the pool
                worker.slow_probes += 1
                if worker.slow_probes < self.config.health_failure_threshold:
                    log.info(
                        "%s worker %s answered no probe within %gs (%d of %d in a row)",
                        worker.role,
                        worker.address,
                        timeout,
                        worker.slow_probes,
                        self.config.health_failure_threshold,
                    )
                    return
        if ok:
            worker.slow_probes = 0
        self._set_health(worker, ok, error)

    def _set_health(self, worker: Worker, ok: bool, error: str) -> None:
        worker.error = error
        if ok == worker.healthy:
            return
        worker.healthy = ok
        if not ok:
            log.warning("%s worker %s is unhealthy: %s", worker.role, worker.address, error)
            return
        load = worker.load
        log.info(
            "%s worker %s is healthy (model %s, max_model_len %s)",
            worker.role,
            worker.address,
            load.model if load else "?",
            load.max_model_len if load else "?",
        )
        # A worker that comes back may be a new process: shake hands again.
        if worker.role == "decode":
            worker.peers.clear()
        else:
            for d in self.of_role("decode"):
                d.peers.pop(worker.address, None)

    # ------------------------------------------------------------------ pairing

    def pair_all(self) -> None:
        for d in self.healthy("decode"):
            for p in self.healthy("prefill"):
                if p.address in d.peers:
                    continue
                if d.model and p.model and d.model != p.model:
                    self._incompatible(d, p, f"different models ({d.model} vs {p.model})")
                    continue
                pairing = Pairing("pending")
                d.peers[p.address] = pairing
                self._spawn(self._pair(d, p, pairing))

    def _incompatible(self, d: Worker, p: Worker, detail: str) -> None:
        d.peers[p.address] = Pairing("incompatible", detail)
        log.error(
            "decode worker %s and prefill worker %s are incompatible, the pair is not used: %s",
            d.address,
            p.address,
            detail,
        )

    async def _pair(self, d: Worker, p: Worker, pairing: Pairing) -> None:
        try:
            await d.stub.AddPrefillPeer(
                decode_pb2.AddPrefillPeerRequest(prefill_address=p.address),
                timeout=self.config.pair_timeout,
            )
        except grpc.aio.AioRpcError as e:
            if d.peers.get(p.address) is not pairing:
                return  # reset meanwhile (a worker restarted): the next round pairs again
            detail = f"{e.code().name}: {e.details()}"
            if e.code() in _INCOMPATIBLE:
                self._incompatible(d, p, detail)
            else:
                log.warning(
                    "pairing decode %s with prefill %s failed, will retry: %s",
                    d.address,
                    p.address,
                    detail,
                )
                del d.peers[p.address]
            return
        if d.peers.get(p.address) is pairing:
            pairing.state = "ok"
            log.info("decode worker %s paired with prefill worker %s", d.address, p.address)

    # ------------------------------------------------------------------ queries

    def of_role(self, role: str) -> list[Worker]:
        return sorted((w for w in self.workers.values() if w.role == role), key=_addr_key)

    def healthy(self, role: str, model: str | None = None) -> list[Worker]:
        return [w for w in self.of_role(role) if w.healthy and (model is None or w.model == model)]

    def usable_pairs(self, model: str | None = None) -> list[tuple[Worker, Any]]:
        if self.colocated:
            return [(d, self.local_prefill) for d in self.healthy("decode", model)]
        prefills = {p.address: p for p in self.healthy("prefill", model)}
        return [
            (d, prefills[a])
            for d in self.healthy("decode", model)
            for a, pairing in sorted(d.peers.items())
            if pairing.state == "ok" and a in prefills
        ]

    @property
    def colocated(self) -> bool:
        """No prefill target: decode workers prefill their own requests."""
        return not any(role == "prefill" for role, _ in self.targets)

    def ready(self) -> bool:
        return bool(self.usable_pairs())

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values() if w.healthy and w.model})

    def max_model_len(self, model: str | None = None) -> int | None:
        lens = [w.load.max_model_len for w in self.healthy("decode", model) if w.load]
        lens = [n for n in lens if n]
        return min(lens) if lens else None


def _addr_key(w: Worker) -> str:
    return w.address
