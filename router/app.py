"""The router's aiohttp application factory. All state lives on the app (STATE key).

Serve it with handler_cancellation=True (run_router does), so a client that goes away
cancels its handler and with it the workers' requests."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from pdpb.heap import GCPauses, freeze_startup_heap, report_gc_pauses
from router.admin import add_admin_routes
from router.config import ADMIN_TOKEN_ENV, RouterConfig
from router.middleware import auth, log_requests, request_context
from router.routes import add_routes
from router.state import STATE, RouterState, SharedFiles

log = logging.getLogger("pdserve.router")


async def _workers_lifecycle(app: web.Application):
    state = app[STATE]
    await state.registry.start()  # channels belong to the app's event loop
    if state.config.admin_token is None:
        log.info("admin endpoints (/admin/workers) off: set --admin-token or %s", ADMIN_TOKEN_ENV)
    if state.config.enable_log_requests:
        log.warning("--enable-log-requests: request bodies (prompts) are logged")
    yield
    await state.registry.close()


async def _gc_pauses(app: web.Application):
    """Every collection's pause in the metrics (pdpb/heap.py)."""
    report = asyncio.ensure_future(
        report_gc_pauses(GCPauses(), app[STATE].metrics.observe_gc_pause)
    )
    yield
    report.cancel()
    await asyncio.gather(report, return_exceptions=True)  # its hook is removed


async def freeze_heap_on_startup(app: web.Application) -> None:
    """An on_startup hook for a process that serves this app and nothing else (the
    CLI's): its startup objects out of the collector's walks (pdpb/heap.py). Not part
    of create_app: freezing is the whole process's business, not an embedded app's."""
    log.info("%d startup objects frozen out of GC", freeze_startup_heap())


def create_app(config: RouterConfig, shared: SharedFiles | None = None) -> web.Application:
    """shared: the files this process shares with its sibling API servers, if any."""
    middlewares = [request_context, auth]
    if config.enable_log_requests:
        middlewares.append(log_requests)  # after auth: no bodies of refused requests
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=middlewares,
        # bodies are inflated by router/body.py, bounded, with OpenAI-shaped errors;
        # aiohttp's parser would answer a bad one in text/plain, outside the app
        handler_args={"auto_decompress": False},
    )
    app[STATE] = RouterState.build(config, shared)
    add_routes(app)
    if config.admin_token is not None:  # else the auth middleware answers 404
        add_admin_routes(app)
    app.cleanup_ctx.append(_workers_lifecycle)
    app.cleanup_ctx.append(_gc_pauses)
    return app
