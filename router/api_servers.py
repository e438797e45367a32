"""--api-server-count N: N router processes serving one port (vLLM's flag).

One Python process streams about 16k tokens/s (docs/performance.md): past that the
router, not the engine, caps throughput. The supervisor (the process started as
`pdserve router`) binds N listening sockets to the port with SO_REUSEPORT, so the
kernel spreads connections over them, and starts an API server process on each. The
processes share the Prometheus metrics (prometheus_client's multiprocess mode, a
directory) and the concurrency limits (a counts file, router/limits.py); each probes
the workers and keeps its own gRPC channels.

When any API server exits the supervisor stops the others and exits 1; SIGTERM or
SIGINT to the supervisor stops them all, each finishing its requests first (aiohttp's
graceful shutdown). An API server whose supervisor is gone (SIGKILL) sees its stdin
close and stops too."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from router.config import RouterConfig
from router.limits import SharedConcurrencyLimit
from router.metrics import MULTIPROC_ENV
from router.state import SharedFiles

log = logging.getLogger("pdserve.router")

BACKLOG = 1024  # connections queued per process before its accept loop runs
STOP_GRACE_S = 70.0  # aiohttp's graceful shutdown takes up to 60 s
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class ServerSpec:
    """What the supervisor hands an API server process on its stdin."""

    index: int
    fd: int  # its listening socket
    config: RouterConfig
    shared: SharedFiles
    log_level: str


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one address, in one SO_REUSEPORT group."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--api-server-count > 1 needs SO_REUSEPORT (Linux, BSD, macOS)")
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    def new_socket() -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # as asyncio's create_server: IPv6 only
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        return s

    # bound once without SO_REUSEPORT first: a port another server holds fails here
    # (EADDRINUSE) instead of silently sharing its connections with it
    with new_socket() as probe:
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        address = (address[0], probe.getsockname()[1], *address[2:])
    sockets = []
    try:
        for _ in range(count):
            s = new_socket()
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(address)
            s.listen(BACKLOG)
    except OSError as e:
        for s in sockets:
            s.close()
        raise ValueError(f"cannot listen on {host}:{address[1]}: {e.strerror}") from None
    return sockets


def run_api_servers(config: RouterConfig, log_level: str) -> int:
    """Supervise config.api_server_count API server processes until SIGTERM / SIGINT (0)
    or until one of them exits (1)."""
    sockets = bind_sockets(config.host, config.port, config.api_server_count)
    run_dir = tempfile.mkdtemp(prefix="pdserve-router-")
    shared = SharedFiles(
        metrics_dir=os.path.join(run_dir, "metrics"), limits_path=os.path.join(run_dir, "limits")
    )
    os.mkdir(shared.metrics_dir)
    SharedConcurrencyLimit.create(shared.limits_path, len(config.api_keys))
    env = dict(os.environ, **{MULTIPROC_ENV: shared.metrics_dir})
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in STOP_SIGNALS}
    servers: list[subprocess.Popen] = []
    try:
        for index, sock in enumerate(sockets):
            spec = ServerSpec(index, sock.fileno(), config, shared, log_level)
            servers.append(_start(spec, env))
        port = sockets[0].getsockname()[1]
        for sock in sockets:
            sock.close()  # the API servers hold them now
        log.info(
            "%d API server processes on %s:%d (pids %s)",
            len(servers),
            config.host,
            port,
            ", ".join(str(p.pid) for p in servers),
        )
        while not stopping.wait(0.2):
            for index, proc in enumerate(servers):
                code = proc.poll()
                if code is not None:
                    log.error("API server %d exited (code %d); stopping the others", index, code)
                    return 1
        return 0
    except OSError as e:  # a process that could not start
        log.error("cannot start the API servers: %s", e)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(servers)
        for sock in sockets:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _start(spec: ServerSpec, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.api_servers"],
        stdin=subprocess.PIPE,
        pass_fds=(spec.fd,),
        env=env,  # in the supervisor's process group: a killpg of it ends them too
    )
    pickle.dump(spec, proc.stdin)
    proc.stdin.flush()  # and kept open: its end tells the process the supervisor is gone
    return proc


def _stop(servers: list[subprocess.Popen]) -> None:
    for proc in servers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in servers:
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()


# ---------------------------------------------------------------- one API server


def _serve(spec: ServerSpec) -> None:
    from aiohttp import web

    from router.app import create_app, freeze_heap_on_startup

    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[{spec.index}]: %(message)s",
    )
    # a terminal's Ctrl-C reaches the whole group; the supervisor then stops each API
    # server once with SIGTERM (a second signal would cut its graceful shutdown short)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    app = create_app(spec.config, spec.shared)
    app.on_startup.append(_stop_on_sigterm_or_orphaned)
    app.on_startup.append(freeze_heap_on_startup)
    web.run_app(
        app,
        sock=socket.socket(fileno=spec.fd),
        backlog=BACKLOG,
        handle_signals=False,
        handler_cancellation=True,  # a client that goes away cancels its worker requests
        access_log=None,
        print=None,
    )


async def _stop_on_sigterm_or_orphaned(app) -> None:
    """aiohttp's graceful shutdown on SIGTERM, and when stdin (the supervisor's pipe)
    closes: the supervisor is gone."""
    import asyncio

    from aiohttp.web_runner import GracefulExit

    loop = asyncio.get_running_loop()

    def graceful_exit() -> None:
        raise GracefulExit()  # out of the event loop: run_app shuts down

    def readable() -> None:
        if not os.read(0, 4096):
            loop.remove_reader(0)
            graceful_exit()

    loop.add_signal_handler(signal.SIGTERM, graceful_exit)
    loop.add_reader(0, readable)


if __name__ == "__main__":
    _serve(pickle.load(sys.stdin.buffer))
