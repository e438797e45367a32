"""The router's aiohttp application factory. All state lives on the app (STATE key).

Serve it with handler_cancellation=True (run_router does), so a client that goes away
cancels its handler and with it the workers' requests."""

from __future__ import annotations

import logging

from aiohttp import web

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
    return app
