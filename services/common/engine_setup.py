"""A worker's engine made ready to serve: the model loaded, warmed up, its KV cache
registered with the transfer engine (every tensor-parallel rank its own). Run by the
worker itself, or by its engine process (engine_core.py)."""

from __future__ import annotations

import functools
import logging

from kvtransfer import create_connector
from services.common.kv import memory_location, register_kv_cache
from services.common.settings import TRANSFER_WRITE_MODES, WorkerSettings
from services.common.worker_kv import WorkerKV
from services.engine import EngineConfig, LLMEngine
from services.engine.startup import StartupPhases
from services.engine.warmup import WarmupReport, warm_up

log = logging.getLogger(__name__)


def load_engine(
    engine_config: EngineConfig, settings: WorkerSettings, phases: StartupPhases
) -> tuple[LLMEngine, WorkerKV, WarmupReport | None]:
    engine = LLMEngine(engine_config, phases)
    try:
        return (engine, *_ready(engine, settings, phases))
    except BaseException:
        engine.close()
        raise


def _ready(engine: LLMEngine, s: WorkerSettings, phases: StartupPhases):
    warmup = None
    if s.skip_warmup:
        log.warning(
            "warm-up skipped (--skip-warmup): the first requests of each batch shape "
            "will compile kernels on the serving path"
        )
    else:
        with phases.phase("warmup"):
            warmup = warm_up(engine)
    kv, spec = engine.runner.kv_cache, engine.runner.kv_spec
    with phases.phase("kv_transfer_registration"):
        kwargs = dict(
            hostname=s.transfer_hostname,
            protocol=s.transfer_protocol,
            metadata=s.transfer_metadata,
            device_name=s.transfer_device,
            direct_writes=TRANSFER_WRITE_MODES[s.transfer_write_mode],
            faults=s.transfer_faults,
        )
        local = create_connector(s.transfer_backend, memory_location=memory_location(kv), **kwargs)
        register_kv_cache(local, kv, spec)
        ranks = engine.runner.ranks
        make = functools.partial(create_connector, s.transfer_backend)
        connector = WorkerKV(local, ranks, make, kwargs)
    log.info("KV transfer: %r", connector)
    if ranks is not None:  # this process freezes its own heap once ready
        frozen = ranks.freeze_heap()
        log.info("tensor-parallel ranks froze %s startup objects out of GC", frozen)
    return connector, warmup
