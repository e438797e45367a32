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
from router.tools import ToolParser, make_tool_parser


@dataclass
class RouterState:
    config: RouterConfig
    registry: WorkerRegistry
    metrics: RouterMetrics
    dispatcher: Dispatcher
    limit: ConcurrencyLimit
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None  # only with enable_auto_tool_choice

    @classmethod
    def build(cls, config: RouterConfig) -> RouterState:
        registry = WorkerRegistry(config)
        metrics = RouterMetrics(workers=lambda: list(registry.workers.values()))
        return cls(
            config=config,
            registry=registry,
            metrics=metrics,
            dispatcher=Dispatcher(registry, metrics),
            limit=ConcurrencyLimit(
                config.max_concurrent_requests, config.max_concurrent_requests_per_key
            ),
            reasoning_parser=(
                make_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
            ),
            tool_parser=(
                make_tool_parser(config.tool_call_parser)
                if config.enable_auto_tool_choice
                else None
            ),
        )


STATE = web.AppKey("pdserve_router_state", RouterState)
