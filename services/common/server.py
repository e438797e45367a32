"""gRPC server plumbing shared by the workers: health service (NOT_SERVING until the
model is loaded), engine + KV connector start-up, graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtransfer import KVConnector
from pdpb import tls
from pdpb.heap import GCPauses, freeze_startup_heap, report_gc_pauses
from pdpb.v1 import common_pb2
from services.common.engine_client import EngineCoreClient, request_checks_for
from services.common.engine_loop import EngineLoop
from services.common.engine_setup import load_engine
from services.common.errors import WorkerFailed
from services.common.interceptor import WorkerInterceptor
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.engine import EngineConfig, LLMEngine
from services.engine.startup import StartupPhases
from services.engine.warmup import WarmupReport

log = logging.getLogger(__name__)
# how long cancelled handlers get at shutdown to abort their requests on the engine
_HANDLER_CLEANUP_S = 10.0


class WorkerContext:
    """What a servicer needs once the worker is ready."""

    def __init__(self, role: str, engine_config: EngineConfig, settings: WorkerSettings):
        self.role = role
        self.engine_config = engine_config
        self.settings = settings
        self.metrics = WorkerMetrics(
            role, model_name=settings.served_model_name or engine_config.model
        )
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.connector: KVConnector | None = None
        self.ready = asyncio.Event()
        self.phases = StartupPhases()
        self.warmup: WarmupReport | None = None
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self.draining = False
        self._drain_callbacks: list[Callable[[], None]] = []
        self._event_loop: asyncio.AbstractEventLoop | None = None

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) when the worker starts to drain."""
        self._drain_callbacks.append(callback)

    def start_drain(self) -> None:
        self.draining = True
        for callback in self._drain_callbacks:
            callback()

    def load(self) -> None:
        """Blocking: load the model, warm it up and register the KV cache with the
        transfer engine (every tensor-parallel rank its own), here or in the engine's
        own process (--engine-process). Each phase logs its duration."""
        if self.settings.engine_process:
            self._start_engine_process()
            return
        engine, connector, self.warmup = load_engine(self.engine_config, self.settings, self.phases)
        self.engine, self.connector = engine, connector
        self.loop = EngineLoop(engine)
        self.loop.start()
        if engine.runner.ranks is not None:
            engine.runner.ranks.watch(self._rank_died)

    def _start_engine_process(self) -> None:
        client = EngineCoreClient(
            self.engine_config,
            self.settings,
            self._engine_died,
            self.metrics.observe_engine_gc_pause,
        )
        client.spawn()
        try:
            checks = request_checks_for(self.engine_config)  # while the engine loads
        except BaseException:
            client.stop(timeout=0)  # still loading: nothing of ours to finish there
            raise
        ready = client.wait_ready()
        self.phases.durations.update(ready["phases"])
        self.warmup = ready["warmup"]
        log.info(
            "the engine process froze %d startup objects out of GC", ready["gc_frozen_objects"]
        )
        self.engine = checks(ready["max_model_len"])
        client.use_tokenizer(self.engine.tokenizer)
        self.connector = client.kv
        self.loop = client

    async def add_kv_peer(self, info, rank_agents) -> None:
        """Check a peer worker against our KV layout and remember it (KVLayoutMismatch
        naming what disagrees), where the transfer engine lives."""
        if self.settings.engine_process:
            await self.loop.add_kv_peer(info, rank_agents)
        else:
            self.connector.add_peer(info, rank_agents)

    def _engine_died(self, reason: str) -> None:
        """From the engine process's reader thread: it is gone (or a rank of it)."""
        self.failure = reason
        log.error("%s: the worker stops serving", reason)
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self.failed.set)

    def _rank_died(self, rank: int, exitcode) -> None:
        """From the ranks' watcher thread: fail every request now (the engine thread
        may be stuck in a collective) and have serve() take the worker down."""
        reason = f"tensor-parallel rank {rank} died (exit code {exitcode})"
        if self.loop is not None:
            self.loop.fail_streams(WorkerFailed(reason))
        self._engine_died(reason)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.settings.engine_process:
            return  # the engine process closed its engine and transfer engine as it ended
        if self.connector is not None:
            self.connector.close()
        if self.engine is not None:
            self.engine.close()


async def serve(
    role: str,
    engine_config: EngineConfig,
    settings: WorkerSettings,
    add_servicers: Callable[[grpc.aio.Server, WorkerContext], list[str]],
) -> None:
    ctx = WorkerContext(role, engine_config, settings)
    ctx._event_loop = asyncio.get_running_loop()
    interceptor = WorkerInterceptor(ctx.ready.is_set)
    server = grpc.aio.server(
        interceptors=[interceptor],
        options=[
            ("grpc.so_reuseport", 0),
            # the router's channel accepts 64 MiB; a request it passes must not meet a
            # smaller limit here (4 MiB by default), which would read as a worker fault
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = add_servicers(server, ctx)
    address = f"{settings.host}:{settings.port}"
    if settings.tls:
        creds = tls.server_credentials(
            settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"cannot listen on {settings.host}:{settings.port}")
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    metrics_port = None
    if settings.metrics_port is not None:
        metrics_server, _ = ctx.metrics.serve(settings.host, settings.metrics_port)
        metrics_port = metrics_server.server_port
    _announce("listening", role, settings.host, port, metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gc_report = None
    try:
        load = asyncio.ensure_future(asyncio.to_thread(ctx.load))
        done, _ = await asyncio.wait(
            [load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if load in done:
            load.result()  # re-raise a load failure
            # the model, tokenizer, graphs and block pool are here for life: out of the
            # collector's walks (pdpb/heap.py), then every later pause is counted
            frozen = freeze_startup_heap()
            gc_report = asyncio.ensure_future(
                report_gc_pauses(GCPauses(), ctx.metrics.observe_gc_pause)
            )
            ctx.ready.set()
            for name in ["", *service_names]:
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info(
                "%s worker ready: %s; %d startup objects frozen out of GC",
                role,
                ctx.phases.summary(),
                frozen,
            )
            _announce(
                "ready",
                role,
                settings.host,
                port,
                metrics_port,
                startup=dict(
                    phases={k: round(v, 3) for k, v in ctx.phases.durations.items()},
                    total_s=round(ctx.phases.total_s, 3),
                    warmup=ctx.warmup.summary() if ctx.warmup is not None else None,
                    gc_frozen_objects=frozen,
                ),
            )
            await asyncio.wait(
                [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ctx.failed.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
    finally:
        if gc_report is not None:
            gc_report.cancel()
        # a failed worker has nothing to drain: its requests have their errors already
        grace = 1.0 if ctx.failure else settings.drain_timeout_s
        log.info("%s worker stopping: draining for up to %.0fs", role, grace)
        await health_servicer.enter_graceful_shutdown()
        ctx.start_drain()  # streams of many requests take no more and end when done
        # New calls are refused; in-flight ones get the drain deadline, then are cancelled
        # (their handlers abort their requests and free the blocks).
        await server.stop(grace=grace)
        # the calls are over, but a cancelled handler's cleanup may still be pending:
        # it must reach the engine before the engine loop stops
        left = await interceptor.finish_handlers(_HANDLER_CLEANUP_S)
        if left:
            log.info("%s worker stopping: cancelled %d call(s) past the drain", role, left)
        ctx.close()
    if ctx.failure:
        raise WorkerFailed(ctx.failure)


def _announce(
    event: str, role: str, host: str, port: int, metrics_port: int | None, **extra
) -> None:
    # One machine-readable line per event, so scripts and tests can find the ports.
    line = {"event": event, "role": role, "address": f"{host}:{port}", "metrics_port": metrics_port}
    line.update(extra)
    data = ("PDSERVE " + json.dumps(line) + "\n").encode()
    sys.stdout.flush()
    # one write(2): a pipe keeps it whole (under PIPE_BUF), so a log line from another
    # thread (Mooncake's relay) cannot land inside it, as one did between print()'s
    # text and its newline and a reader never saw the worker ready
    os.write(sys.stdout.fileno(), data)


async def load_report(ctx: WorkerContext, role: int) -> common_pb2.LoadReport:
    stats, audit = await ctx.loop.load()
    stats = {**stats, **audit.as_dict()}
    ctx.metrics.update_load(stats)
    kv = ctx.connector.stats()
    return common_pb2.LoadReport(
        role=role,
        model=ctx.engine_config.model,
        num_running=stats["num_running"],
        num_waiting=stats["num_waiting"],
        num_free_blocks=stats["num_free_blocks"],
        num_total_blocks=stats["num_total_blocks"],
        max_model_len=ctx.engine.max_model_len,
        kv_transfers_ok=int(kv.get("transfers_ok", 0)),
        kv_transfers_failed=int(kv.get("transfers_failed", 0)),
        kv_transfer_bytes=int(kv.get("bytes", 0)),
        prefill_fallbacks=ctx.metrics.num_prefill_fallbacks,
        orphaned_kv_blocks=audit.orphaned_blocks,
        oldest_kv_reservation_seconds=audit.oldest_reservation_s,
    )
