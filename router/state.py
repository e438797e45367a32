"""The router's per-app state, stored on the aiohttp application (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.limits import ConcurrencyLimit, SharedConcurrencyLimit, key_digest
from router.metrics import RouterMetrics
from router.reasoning import ReasoningParser, make_reasoning_parser
from router.registry import WorkerRegistry
from router.tools import ToolParser, make_tool_parser


@dataclass(frozen=True)
class SharedFiles:
    """What an API server process shares with the others (--api-server-count > 1)."""

    metrics_dir: str  # prometheus_client's multiprocess directory
    limits_path: str  # SharedConcurrencyLimit's counts


@dataclass
class RouterState:
    config: RouterConfig
    registry: WorkerRegistry
    metrics: RouterMetrics
    dispatcher: Dispatcher
    limit: ConcurrencyLimit | SharedConcurrencyLimit
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None  # only with enable_auto_tool_choice

    @classmethod
    def build(cls, config: RouterConfig, shared: SharedFiles | None = None) -> RouterState:
        registry = WorkerRegistry(config)
        metrics = RouterMetrics(
            workers=lambda: list(registry.workers.values()),
            multiprocess_dir=shared.metrics_dir if shared else None,
        )
        limits = (config.max_concurrent_requests, config.max_concurrent_requests_per_key)
        return cls(
            config=config,
            registry=registry,
            metrics=metrics,
            dispatcher=Dispatcher(registry, metrics),
            limit=(
                SharedConcurrencyLimit(shared.limits_path, *limits, api_key_digests(config))
                if shared
                else ConcurrencyLimit(*limits)
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


def api_key_digests(config: RouterConfig) -> list[bytes]:
    """The configured keys as the auth middleware identifies them (api_key_id)."""
    return [key_digest(k) for k in config.api_keys]


STATE = web.AppKey("pdserve_router_state", RouterState)
