"""The router's aiohttp application factory. All state lives on the app (STATE key).

Serve it with handler_cancellation=True (run_router does), so a client that goes away
cancels its handler and with it the workers' requests."""

from __future__ import annotations

import logging

from aiohttp import web

from router.admin import add_admin_routes
from router.config import RouterConfig
from router.middleware import auth, request_context
from router.routes import add_routes
from router.state import STATE, RouterState

log = logging.getLogger("pdserve.router")


async def _workers_lifecycle(app: web.Application):
    state = app[STATE]
    await state.registry.start()  # channels belong to the app's event loop
    if state.config.admin_token is None:
        log.warning("no admin token: /admin/workers is open to anyone who reaches the router")
    yield
    await state.registry.close()


def create_app(config: RouterConfig) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[request_context, auth]
    )
    app[STATE] = RouterState.build(config)
    add_routes(app)
    add_admin_routes(app)
    app.cleanup_ctx.append(_workers_lifecycle)
    return app
