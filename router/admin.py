"""Admin endpoints: list, add and remove workers at run time.

GET /admin/workers; POST and DELETE /admin/workers with {"role", "address"} (DELETE
also takes them as query parameters). Registered only with an admin token, which every
call must carry (Authorization: Bearer, or X-Admin-Token); without one they are off."""

from __future__ import annotations

from aiohttp import web

from router.config import ROLES
from router.errors import APIError, bad_request
from router.request_id import REQUEST_LOG
from router.routes import read_json
from router.state import STATE


async def _target(request: web.Request) -> tuple[str, str]:
    if request.method == "DELETE" and not request.can_read_body:
        body = dict(request.query)
    else:
        body = await read_json(request, request.app[STATE].config.max_body_bytes)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object {role, address}")
    role, address = body.get("role"), body.get("address")
    if role not in ROLES:
        raise bad_request(f"'role' must be one of {list(ROLES)}", "role")
    if not isinstance(address, str):
        raise bad_request("'address' must be a 'host:port' string", "address")
    return role, address


async def list_workers(request: web.Request) -> web.Response:
    registry = request.app[STATE].registry
    return web.json_response(
        {
            "workers": [w.describe() for r in ROLES for w in registry.of_role(r)],
            "targets": [
                {"role": role, "address": spec, "origin": t.origin, "resolved": sorted(t.addresses)}
                for (role, spec), t in sorted(registry.targets.items())
            ],
        }
    )


async def add_worker(request: web.Request) -> web.Response:
    role, address = await _target(request)
    try:
        resolved = await request.app[STATE].registry.add_target(role, address, origin="admin")
    except ValueError as e:
        raise bad_request(str(e), "address") from None
    request[REQUEST_LOG].info("admin: added %s worker %s -> %s", role, address, resolved)
    return web.json_response({"role": role, "address": address, "resolved": resolved}, status=201)


async def remove_worker(request: web.Request) -> web.Response:
    role, address = await _target(request)
    try:
        removed = request.app[STATE].registry.remove_target(role, address)
    except ValueError as e:
        raise bad_request(str(e), "address") from None
    if not removed:
        raise APIError(404, f"no {role} worker {address} is registered", code="worker_not_found")
    request[REQUEST_LOG].info("admin: removed %s worker %s", role, address)
    return web.json_response({"role": role, "address": address, "removed": True})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/workers", list_workers)
    app.router.add_post("/admin/workers", add_worker)
    app.router.add_delete("/admin/workers", remove_worker)
