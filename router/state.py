"""The router's per-app state, stored on the aiohttp application (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.limits import ConcurrencyLimit
from router.metrics import RouterMetrics
from router.reasoning import ReasoningParser, make_reasoning_parser
from router.registry import WorkerRegistry


@dataclass
class RouterState:
    config: RouterConfig
    registry: WorkerRegistry
    metrics: RouterMetrics
    dispatcher: Dispatcher
    limit: ConcurrencyLimit
    reasoning_parser: ReasoningParser | None = None

    @classmethod
    def build(cls, config: RouterConfig) -> RouterState:
        registry = WorkerRegistry(config)
        metrics = RouterMetrics(workers=lambda: list(registry.workers.values()))
        return cls(
            config=config,
            registry=registry,
            metrics=metrics,
            dispatcher=Dispatcher(registry, metrics),
            limit=ConcurrencyLimit(config.max_concurrent_requests),
            reasoning_parser=(
                make_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
            ),
        )


STATE = web.AppKey("pdserve_router_state", RouterState)
