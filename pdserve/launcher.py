"""`pdserve up`: router + N prefill + M decode workers as processes on this machine.

Workers start on free ports (--port 0, the chosen port is read from their announce
line), then the router is started with their addresses. A worker that dies later is
started again on its address (--restart, like compose's restart policy), where the
router's health probes find it again; the router keeps serving on the others meanwhile.
Ctrl-C or SIGTERM stops them all, and so does the router dying, a worker failing its
first start, or a worker failing --max-restarts restarts in a row before it is ready.
Meant for trying pdserve on one machine; production runs each process on its own
(docker compose, Helm)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

PDSERVE = [sys.executable, "-m", "pdserve"]
RESTART_POLICIES = ("on-failure", "always", "never")
BACKOFF_FIRST_S = 1.0  # delay before a restart, doubled per restart up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a worker ready this long before it died starts over at BACKOFF_FIRST_S


class Child:
    """A pdserve process; its `PDSERVE {...}` announce lines give its address and
    readiness. echo: copy its output to ours, each line prefixed with its name;
    `recent` keeps its last lines either way (what to show when it fails to start)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], echo: bool = True):
        self.name = name
        self.echo = echo
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.address: str | None = None
        self.ready = threading.Event()
        self.ready_at: float | None = None  # time.monotonic() of its ready line
        self._group_killed = False
        self.recent: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("PDSERVE "):
                event = json.loads(line[len("PDSERVE ") :])
                self.address = event["address"]
                if event["event"] == "ready":
                    self.ready_at = time.monotonic()
                    self.ready.set()
                    startup = event.get("startup")
                    if startup:  # one line per worker: its start-up phases and total
                        phases = ", ".join(f"{k} {v:.1f}s" for k, v in startup["phases"].items())
                        print(
                            f"pdserve up: {self.name} ready in {startup['total_s']:.1f}s "
                            f"({phases}), pid {self.proc.pid}",
                            flush=True,
                        )
                    continue  # the full event (warm-up shapes) is too long to echo
            self.recent.append(line)
            if self.echo:
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()

    def stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL what is left of its process group once it has exited: a tensor-parallel
        worker's rank processes (they also die with it, PR_SET_PDEATHSIG; this makes sure
        none still holds a device when the worker starts again). Once, right after its
        exit was seen: later, an empty group's id may belong to another process."""
        if self._group_killed:
            return
        self._group_killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def exit_reason(code: int) -> str:
    """Popen.returncode in words: 'exit code 1', 'signal SIGKILL'."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def restart_settings(args) -> tuple[str, int]:
    """(--restart, --max-restarts), checked."""
    policy = getattr(args, "restart", "on-failure")
    if policy not in RESTART_POLICIES:
        raise ValueError(f"--restart {policy!r}: choose one of {', '.join(RESTART_POLICIES)}")
    limit = getattr(args, "max_restarts", 3)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"--max-restarts must be an integer >= 1, got {limit!r}")
    return policy, limit


def _say(message: str) -> None:
    print(f"pdserve up: {message}", file=sys.stderr, flush=True)


class Supervised:
    """A worker under a restart policy. When it dies it is started again after a backoff
    (BACKOFF_FIRST_S doubling to BACKOFF_MAX_S) on the port it had, so the router, which
    keeps probing the addresses it was given, takes it back into its pool. start(port)
    starts one life of it (port 0: any free port, for the first)."""

    def __init__(self, name: str, start, policy: str = "on-failure", max_restarts: int = 3):
        self.name, self.policy, self.max_restarts = name, policy, max_restarts
        self._start = start
        self.child: Child = start(0)
        self.port = 0
        self.restarts = 0
        self.failed_starts = 0  # restarts in a row that exited before they were ready
        self.backoff = BACKOFF_FIRST_S
        self.restart_at: float | None = None
        self.left_down = False  # stopped on purpose under on-failure: not restarted

    def step(self, now: float) -> str | None:
        """Notice an exit, or restart when due. Returns why everything must stop, or None."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.restarts += 1
                self.child = self._start(self.port)
                _say(f"{self.name} restarted (pid {self.child.proc.pid}, restart {self.restarts})")
            return None
        code = None if self.left_down else self.child.proc.poll()
        if code is None:
            return None
        child = self.child
        child.kill_group()
        how = exit_reason(code)
        if self.policy == "never":
            return f"{self.name} exited ({how}); stopping (--restart never)"
        if code == 0 and self.policy == "on-failure":  # someone sent it SIGTERM: respect it
            self.left_down = True
            _say(f"{self.name} exited ({how}); not restarted (--restart on-failure)")
            return None
        if child.ready.is_set():
            self.failed_starts = 0
            if self.port == 0 and child.address:
                self.port = int(child.address.rsplit(":", 1)[1])
            if now - child.ready_at >= STABLE_S:
                self.backoff = BACKOFF_FIRST_S
        else:
            self.failed_starts += 1
            if self.failed_starts >= self.max_restarts:
                return (
                    f"{self.name} exited ({how}) before it was ready, {self.failed_starts} "
                    f"restarts in a row (--max-restarts {self.max_restarts}); stopping"
                )
        _say(
            f"{self.name} (pid {child.proc.pid}) exited ({how}); "
            f"restart {self.restarts + 1} in {self.backoff:g}s"
        )
        self.restart_at = now + self.backoff
        self.backoff = min(2 * self.backoff, BACKOFF_MAX_S)
        return None


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_TP_FLAGS = ("--prefill-tp", "--decode-tp")


def tensor_parallel_sizes(args) -> dict[str, int]:
    """{role: TP degree} from --prefill-tp / --decode-tp (default 1)."""
    sizes = {}
    for role, flag in zip(("prefill", "decode"), _TP_FLAGS, strict=True):
        size = getattr(args, f"{role}_tp", 1)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {size!r}")
        sizes[role] = size
    return sizes


def gpu_range(device: str, tp: int) -> range | None:
    """GPU indices a worker on `device` with TP `tp` uses (cuda:K -> K..K+tp-1; bare cuda
    is cuda:0); None on CPU."""
    if not device.startswith("cuda"):
        return None
    base = int(device.split(":")[1]) if ":" in device else 0
    return range(base, base + tp)


def plan_workers(args) -> list[tuple[str, str]]:
    """(name, device) of every worker: --prefill-device / --decode-device are
    comma-separated lists that worker i of that role takes entry i of (cycled); --device
    is the default for both. A worker with TP N (--prefill-tp / --decode-tp) on cuda:K
    uses GPUs K..K+N-1; ValueError when such a range overlaps another worker's GPUs
    (workers without TP may still share a GPU)."""
    tp = tensor_parallel_sizes(args)
    plan, flags = [], {}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        own = getattr(args, f"{role}_device", None)
        flag = f"--{role}-device" if own else "--device"
        devices = [d.strip() for d in (own or args.device).split(",")]
        for d in devices:
            if _DEVICE.fullmatch(d) is None:
                raise ValueError(f"{flag}: {d!r} is not cpu, cuda or cuda:N")
        for i in range(count):
            plan.append((f"{role}-{i}", devices[i % len(devices)]))
            flags[plan[-1][0]] = flag
    _check_gpu_overlap(plan, flags, tp)
    return plan


def _check_gpu_overlap(plan, flags: dict[str, str], tp: dict[str, int]) -> None:
    def gpus(name: str, device: str) -> range | None:
        return gpu_range(device, tp[name.split("-")[0]])

    def describe(name: str, device: str) -> str:
        r = gpus(name, device)
        span = f"GPU {r[0]}" if len(r) == 1 else f"GPUs {r[0]}-{r[-1]}"
        return f"{name} ({flags[name]} {device}, --{name.split('-')[0]}-tp {len(r)}: {span})"

    for i, (a, dev_a) in enumerate(plan):
        for b, dev_b in plan[i + 1 :]:
            ra, rb = gpus(a, dev_a), gpus(b, dev_b)
            if ra is None or rb is None or len(ra) == len(rb) == 1:
                continue  # CPU, or two single-GPU workers sharing one (allowed)
            shared = sorted(set(ra) & set(rb))
            if shared:
                raise ValueError(
                    f"{describe(a, dev_a)} and {describe(b, dev_b)} share GPU {shared[0]}: "
                    "a tensor-parallel worker needs its GPUs to itself; give each worker "
                    "its own range with --prefill-device / --decode-device "
                    "(e.g. --prefill-tp 2 --prefill-device cuda:0 --decode-device cuda:2)"
                )


def _tp_in_worker_args(worker_args: list[str]) -> bool:
    for a in worker_args:
        opt = a.split("=", 1)[0]
        if opt.startswith("-tp") or (len(opt) > 4 and "--tensor-parallel-size".startswith(opt)):
            return True
    return False


def transport_hint(plan: list[tuple[str, str]], worker_args: list[str]) -> str | None:
    """Prefill and decode workers all on GPUs with the default TCP transfer: the KV would
    cross through host sockets (~1.4 GB/s on an H200 host) instead of NVLink (~250)."""
    roles = {name.split("-")[0] for name, _ in plan}
    if (
        roles == {"prefill", "decode"}
        and all(device.startswith("cuda") for _, device in plan)
        and not any(a.startswith("--transfer-protocol") for a in worker_args)
    ):
        return (
            "the KV cache moves between GPUs over TCP; for GPUs of one host add "
            "`-- --transfer-protocol nvlink_intra`"
        )
    return None


def _check_tool_flags(args) -> None:
    """The router's tool-calling flags, checked before anything starts."""
    from router.tools import TOOL_PARSERS

    parser = getattr(args, "tool_call_parser", None)
    if parser is not None and parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {parser!r}: choose one of {', '.join(sorted(TOOL_PARSERS))}"
        )
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


def run_up(args, worker_args: list[str]) -> int:
    plan = plan_workers(args)  # ValueError before anything starts
    tp = tensor_parallel_sizes(args)
    if _tp_in_worker_args(worker_args):
        raise ValueError(
            "--tensor-parallel-size / -tp after --: use --prefill-tp / --decode-tp, which "
            "also give each worker its GPUs"
        )
    if args.reasoning_parser is not None:
        from router.reasoning import REASONING_PARSERS

        if args.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {args.reasoning_parser!r}: choose one of "
                f"{', '.join(sorted(REASONING_PARSERS))}"
            )
    _check_tool_flags(args)
    if getattr(args, "api_server_count", 1) < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    hint = transport_hint(plan, worker_args)
    if hint:
        print(f"pdserve up: {hint}", file=sys.stderr)
    policy, max_restarts = restart_settings(args)
    # workers route Mooncake's own log lines through their logging (--log-level)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")] if p
    )
    workers: list[Supervised] = []
    router: Child | None = None
    stopping = threading.Event()

    def stop_all(*_):
        stopping.set()

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)

    def starter(name: str, device: str):
        role = name.split("-")[0]

        def start(port: int) -> Child:
            cmd = [*PDSERVE, role, "--model", args.model, "--device", device]
            cmd += ["--port", str(port), "--tensor-parallel-size", str(tp[role])]
            engine_process = getattr(args, "decode_engine_process", None)
            if role == "decode" and engine_process is not None:
                cmd.append("--engine-process" if engine_process else "--no-engine-process")
            return Child(name, [*cmd, *worker_args], env)

        return start

    port = getattr(args, "port", 0)  # 0 (or none, in a test double): nothing to hold
    reserved = _reserve_port(args.host, port) if port else None
    try:
        for name, device in plan:
            workers.append(Supervised(name, starter(name, device), policy, max_restarts))
        for w in workers:
            while not w.child.ready.wait(0.5):
                if stopping.is_set():
                    return 1
                code = w.child.proc.poll()
                if code is not None:  # a first start failing is a configuration error
                    _say(f"{w.name} exited ({exit_reason(code)}) before it was ready; stopping")
                    return 1
        router_cmd = [*PDSERVE, "router", "--host", args.host, "--port", str(args.port)]
        for w in workers:
            router_cmd += [f"--{w.name.split('-')[0]}", w.child.address]
        if args.reasoning_parser:
            router_cmd += ["--reasoning-parser", args.reasoning_parser]
        if getattr(args, "tool_call_parser", None):
            router_cmd += ["--tool-call-parser", args.tool_call_parser]
        if getattr(args, "enable_auto_tool_choice", False):
            router_cmd += ["--enable-auto-tool-choice"]
        if getattr(args, "api_server_count", 1) != 1:
            router_cmd += ["--api-server-count", str(args.api_server_count)]
        if reserved is not None:  # the workers have their ports: the router takes its own
            reserved.close()
            reserved = None
        router = Child("router", router_cmd, env)
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        announced = False
        while not stopping.is_set():
            code = router.proc.poll()
            if code is not None:  # the front door: its crash is a bug to see, not to hide
                _say(f"router exited ({exit_reason(code)}); stopping (it is not restarted)")
                return 1
            for w in workers:
                fatal = w.step(time.monotonic())
                if fatal:
                    _say(fatal)
                    return 1
            if not announced and _ready(url):
                announced = True
                print(f"pdserve is ready: {url}/v1  (model {args.model}; Ctrl-C stops)", flush=True)
            stopping.wait(0.5)
        return 0 if announced else 1
    finally:
        if reserved is not None:
            reserved.close()
        if router is not None:  # first, so no new requests reach workers
            router.stop(timeout=30)
        for w in reversed(workers):
            w.child.stop(timeout=30)
        restarted = [f"{w.name} {w.restarts}" for w in workers if w.restarts]
        print(f"pdserve up: stopped; worker restarts: {', '.join(restarted) or 'none'}", flush=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):  # not up, or not HTTP/1 (not the router)
        return False


def _reserve_port(host: str, port: int) -> socket.socket | None:
    """A socket bound to the router's address while the workers start: they take any
    free port (--port 0), and the kernel never hands out one that is bound, so a worker
    cannot take the router's (seen with a router port from the ephemeral range: the
    readiness probe then met a gRPC server). No SO_REUSEADDR, which would let it share;
    None when the bind fails (a port in TIME_WAIT, say): the router then binds it or
    reports why not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError:
        return None
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        return None
    return sock
