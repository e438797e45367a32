"""`pdserve up` survives a worker (issue 18): a worker that dies is started again on its
address after a backoff and rejoins the router's pool while the others keep serving; a
worker that keeps failing to start, or the router dying, stops everything. Real
processes on CPU with the default model, except the backoff arithmetic."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from pdserve import launcher
from pdserve.cli import main

PROMPT = "The capital of France is"


class Stack:
    """`pdserve up` as a process; its output lines are collected as they come."""

    def __init__(self, model_dir, *flags: str, worker_flags: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "up", "--model", str(model_dir)]
        cmd += ["--port", str(self.port), *flags, "--", "--skip-warmup", *worker_flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
        )
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> re.Match:
        """The `count`-th output line matching `pattern` (re.search)."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                found = [m for m in map(re.compile(pattern).search, self.lines) if m]
                if len(found) >= count:
                    return found[count - 1]
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} in time:\n{self.tail()}"
                self._new_line.wait(left)

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def worker_pid(self, name: str, count: int = 1, timeout: float = 5) -> int:
        pattern = rf"^pdserve up: {name} ready in .*, pid (\d+)$"
        return int(self.wait_for(pattern, timeout, count)[1])

    def worker_address(self, name: str, count: int = 1) -> str:
        line = self.wait_for(rf"^\[{name}\] PDSERVE ", 5, count).string
        return json.loads(line.split("PDSERVE ", 1)[1])["address"]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ready(self) -> tuple[int, dict]:
        status, body = self.get("/ready")
        return status, json.loads(body)

    def worker_series(self) -> dict[tuple[str, str], float]:
        """{(metric, address): value} of the router's per-worker gauges (no admin token)."""
        series = re.findall(
            r'^pdserve_router_worker_(healthy|requests_total)\{address="([^"]+)",role="\w+"\} (\S+)',
            self.get("/metrics")[1],
            re.M,
        )
        return {(name, address): float(value) for name, address, value in series}

    def poll(self, check, timeout: float, what: str):
        """Poll check() until it returns something truthy (the router probes every 2 s)."""
        deadline = time.monotonic() + timeout
        while not (result := check()):
            assert time.monotonic() < deadline, f"{what}: not in {timeout}s\n{self.tail()}"
            time.sleep(0.1)
        return result

    def descendants(self) -> list[int]:
        """Every process below `pdserve up` (workers, router, their children)."""
        found, todo = [], [self.proc.pid]
        while todo:
            parent = todo.pop()
            kids = [p for p in _pids() if _ppid(p) == parent]
            found += kids
            todo += kids
        return found

    def close(self) -> None:
        """After a failed test: stop the stack without orphaning its processes (they run
        in their own sessions, so killing `pdserve up` alone would leave them)."""
        if self.proc.poll() is not None:
            return
        pids = self.descendants()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=4)
    return out.choices[0].text


def test_killed_decode_worker_is_restarted_and_serves_again(default_model_dir):
    """1 prefill + 2 decode: SIGKILL decode-1; decode-0 answers alone meanwhile (the
    router's /ready still 200, one pair), decode-1 comes back with a new pid on its
    address and takes requests again; SIGTERM then ends every process."""
    import openai

    from tests.workers.procs import Worker

    stack = Stack(default_model_dir, "--prefill", "1", "--decode", "2")
    try:
        stack.wait_for(r"^pdserve is ready", 180)
        old_pid = stack.worker_pid("decode-1")
        d0, d1 = stack.worker_address("decode-0"), stack.worker_address("decode-1")
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        expected = _complete(client, model)
        assert expected

        os.kill(old_pid, signal.SIGKILL)
        stack.poll(lambda: stack.worker_series()[("healthy", d1)] == 0, 20, "decode-1 unhealthy")
        status, body = stack.ready()
        assert status == 200 and body["healthy_decode"] == 1 and body["pairs"] == 1, body
        before = stack.worker_series()
        assert [_complete(client, model) for _ in range(4)] == [expected] * 4
        after = stack.worker_series()
        assert after[("healthy", d1)] == 0  # still down: all four went to decode-0
        assert after[("requests_total", d0)] - before[("requests_total", d0)] == 4
        assert after[("requests_total", d1)] == before[("requests_total", d1)]

        stack.wait_for(rf"decode-1 \(pid {old_pid}\) exited \(signal SIGKILL\); restart 1 in 1s", 5)
        new_pid = stack.worker_pid("decode-1", count=2, timeout=60)
        assert new_pid != old_pid and _alive(new_pid) and not _alive(old_pid)
        assert stack.worker_address("decode-1", count=2) == d1  # the same port
        stack.poll(lambda: stack.ready()[1]["pairs"] == 2, 30, "decode-1 paired again")
        served = before[("requests_total", d1)]
        for _ in range(6):  # least_load takes turns between idle workers
            assert _complete(client, model) == expected
        assert stack.worker_series()[("requests_total", d1)] > served, "decode-1 served nothing"
        for role, address in (("prefill", stack.worker_address("prefill-0")), ("decode", d0)):
            report = Worker(role, stack.proc, address).wait_all_blocks_free(timeout=5)
            assert report.num_free_blocks == report.num_total_blocks > 0
        report = Worker("decode", stack.proc, d1).wait_all_blocks_free(timeout=5)
        assert report.num_free_blocks == report.num_total_blocks > 0
        assert report.prefill_fallbacks == 0  # its KV came from prefill-0, not recomputed

        pids = stack.descendants()
        assert new_pid in pids and len(pids) >= 4, pids  # router + 3 workers
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(90) == 0, stack.tail()
        assert "pdserve up: stopped; worker restarts: decode-1 1\n" in stack.lines
        assert not [p for p in pids if _alive(p)], "a process outlived pdserve up"
    finally:
        stack.close()


def test_worker_failing_every_restart_stops_everything(default_model_dir):
    """decode-0 (the only decode worker) killed, its port then taken: each restart exits
    before it is ready, and the second in a row stops the stack, naming it. Meanwhile the
    router's /ready says 503: no decode worker."""
    stack = Stack(default_model_dir, "--prefill", "0", "--decode", "1", "--max-restarts", "2")
    holder = socket.socket()
    try:
        stack.wait_for(r"^pdserve is ready", 180)
        pid = stack.worker_pid("decode-0")
        pids = stack.descendants()
        port = int(stack.worker_address("decode-0").rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT

        def take_port() -> bool:  # free once the kernel has closed the dead worker's
            try:
                holder.bind(("127.0.0.1", port))
            except OSError:
                return False
            holder.listen()
            return True

        stack.poll(take_port, 5, "the dead worker's port free")
        stack.poll(lambda: stack.ready()[0] == 503, 20, "/ready 503")
        assert stack.ready()[1]["healthy_decode"] == 0
        assert stack.proc.wait(90) == 1, stack.tail()
        out = "".join(stack.lines)
        assert f"decode-0 (pid {pid}) exited (signal SIGKILL); restart 1 in 1s" in out
        assert re.search(
            r"decode-0 \(pid \d+\) exited \(exit code [1-9]\d*\); restart 2 in 2s", out
        )
        assert len(re.findall(r"decode-0 restarted \(pid \d+, restart \d\)", out)) == 2
        assert re.search(
            r"pdserve up: decode-0 exited \(exit code [1-9]\d*\) before it was ready, 2 "
            r"restarts in a row \(--max-restarts 2\); stopping",
            out,
        ), stack.tail()
        assert "worker restarts: decode-0 2" in out
        assert not [p for p in pids if _alive(p)], "a process outlived pdserve up"
    finally:
        holder.close()
        stack.close()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_router_dying_stops_everything(default_model_dir, api_servers):
    """The router is not restarted: its death stops the stack with a message naming it.
    With --api-server-count 2 its API server processes go with it."""
    stack = Stack(
        default_model_dir, "--prefill", "0", "--decode", "1", "--api-server-count", str(api_servers)
    )
    try:
        stack.wait_for(r"^pdserve is ready", 180)
        pids = stack.descendants()
        servers = [p for p in pids if "router.api_servers" in _cmdline(p)]
        assert len(servers) == (api_servers if api_servers > 1 else 0), pids
        [router] = [p for p in pids if " router " in _cmdline(p)]
        os.kill(router, signal.SIGKILL)
        assert stack.proc.wait(60) == 1, stack.tail()
        assert "pdserve up: router exited (signal SIGKILL); stopping" in "".join(stack.lines)
        assert not [p for p in pids if _alive(p)], "a process outlived pdserve up"
    finally:
        stack.close()


# ---------------------------------------------------------------- without a model


class _Life:
    """One fake life of a worker: it has exited with `code`, ready before or not."""

    def __init__(self, code: int, ready: bool):
        self.proc = SimpleNamespace(poll=lambda: code, pid=1000)
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.ready_at, self.address = 0.0, "127.0.0.1:4321"

    def kill_group(self):
        pass


def _supervise(lives, policy="on-failure", max_restarts=3, clock=(0.0,)):
    ports = []

    def start(port):  # a life is ready at the time it starts
        ports.append(port)
        lives[0].ready_at = clock[0]
        return lives.pop(0)

    return launcher.Supervised("decode-0", start, policy, max_restarts), ports


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run(capsys):
    clock = [0.0]
    lives = [_Life(-9 if i == 0 else 1, ready=True) for i in range(8)]
    w, ports = _supervise(lives, clock=clock)
    delays = []
    for _ in range(7):  # each life crashes right after it is ready
        assert w.step(clock[0]) is None  # notices the exit
        delays.append(w.restart_at - clock[0])
        clock[0] = w.restart_at
        assert w.step(clock[0]) is None  # starts the next life
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    clock[0] += launcher.STABLE_S  # the last life stays up a minute before it crashes
    assert w.step(clock[0]) is None and w.restart_at - clock[0] == 1
    assert ports == [0] + [4321] * 7  # every restart on the port the first life had
    err = capsys.readouterr().err
    assert "decode-0 (pid 1000) exited (signal SIGKILL); restart 1 in 1s" in err
    assert "decode-0 (pid 1000) exited (exit code 1); restart 6 in 30s" in err


def test_policies_never_and_on_failure_exit_zero_and_failed_starts(capsys):
    w, _ = _supervise([_Life(-15, ready=True)], policy="never")
    assert w.step(0) == "decode-0 exited (signal SIGTERM); stopping (--restart never)"
    # on-failure: exit code 0 (stopped on purpose) is left down; always restarts it
    w, _ = _supervise([_Life(0, ready=True)])
    assert w.step(0) is None and w.step(100) is None and w.restart_at is None
    assert "decode-0 exited (exit code 0); not restarted (--restart on-failure)" in (
        capsys.readouterr().err
    )
    w, _ = _supervise([_Life(0, ready=True), _Life(0, ready=True)], policy="always")
    assert w.step(0) is None and w.restart_at == 1
    # failing starts: counted in a row, reset by a life that got ready
    lives = [_Life(-9, ready=True), _Life(1, False), _Life(-9, True), _Life(1, False)]
    w, _ = _supervise([*lives, _Life(1, False)], max_restarts=2)
    for now in range(8):
        assert w.step(now * 100) is None
    assert w.step(800) == (
        "decode-0 exited (exit code 1) before it was ready, 2 restarts in a row "
        "(--max-restarts 2); stopping"
    )


def test_a_dead_workers_process_group_goes_with_it():
    """A tensor-parallel worker's ranks are its children in its process group: when the
    worker dies, what is left of the group is killed before it starts again."""
    script = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    child = launcher.Child("decode-0", [sys.executable, "-c", script], os.environ, echo=False)
    w = launcher.Supervised("decode-0", lambda port: child)
    try:
        deadline = time.monotonic() + 10
        while not (rank := [p for p in _pids() if _ppid(p) == child.proc.pid]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.proc.kill()
        child.proc.wait(5)
        assert _alive(rank[0])  # a plain child outlives its parent...
        w.step(time.monotonic())
        deadline = time.monotonic() + 5
        while _alive(rank[0]):  # ...but not the supervisor
            assert time.monotonic() < deadline, "the rank outlived its worker"
            time.sleep(0.05)
    finally:
        child.stop(5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--restart", "unless-stopped"], "--restart 'unless-stopped': choose one of on-failure"),
        (["--max-restarts", "0"], "--max-restarts must be an integer >= 1, got 0"),
    ],
)
def test_bad_restart_flags_are_refused_before_starting(argv, message, capsys):
    assert main(["up", "--port", "1", *argv]) == 2
    assert message in capsys.readouterr().err
