"""Test helpers: the router app served on a free port in a background thread, and a
tiny HTTP client (urllib) for raw requests."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

from aiohttp import web

from router.app import create_app
from router.config import RouterConfig
from router.state import STATE


class RouterThread:
    """`with RouterThread(config) as r:` serves create_app(config) at r.url."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.app = create_app(config)
        self.state = self.app[STATE]
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    def call(self, coro):
        """Run a coroutine on the router's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def run_sync(self, fn):
        async def wrapper():
            return fn()

        return self.call(wrapper())

    async def _start(self):
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> RouterThread:
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc) -> None:
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in req.headers:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return Reply(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, dict(e.headers), e.read())


def assert_openai_error(reply: Reply, status: int, param=None, code=None) -> dict:
    """The reply has `status` and OpenAI's error body; returns the error object."""
    assert reply.status == status, (reply.status, reply.body)
    body = reply.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
