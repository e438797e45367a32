"""docker-compose.yml, run without Docker: every service's exact command and environment
as a local process (see tests/deploy/compose.py for the container -> local mapping),
started in depends_on order, each waited for with its own compose healthcheck, then a
chat completion through the router with the official `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.deploy import compose

API_KEY = "compose-test-key"
PDSERVE = os.environ.get("PDSERVE_BIN", str(Path(sys.executable).parent / "pdserve"))


def _router_wired() -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [PDSERVE, "router", "--help"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return proc.returncode == 0, proc.stderr[-500:]


class Running:
    def __init__(self, service: compose.LocalService, log_dir: Path):
        self.service = service
        self.log_path = log_dir / f"{service.name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, **service.env}
        self.proc = subprocess.Popen(
            service.command, stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True
        )

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def healthy(self) -> bool:
        hc = self.service.healthcheck
        if hc is None:
            return self.proc.poll() is None
        return subprocess.run(hc, capture_output=True, timeout=30).returncode == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM, as `docker compose down`
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _wait_healthy(running: list[Running], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(running)
    while pending:
        for r in list(pending):
            if r.proc.poll() is not None:
                pytest.fail(
                    f"{r.service.name} exited with {r.proc.returncode} before it was "
                    f"healthy:\n{r.tail()}"
                )
            if r.healthy():
                pending.remove(r)
        if pending and time.monotonic() > deadline:
            names = ", ".join(r.service.name for r in pending)
            pytest.fail(f"not healthy after {timeout:.0f}s: {names}\n{pending[0].tail()}")
        if pending:
            time.sleep(1.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model_dir):
    ok, why = _router_wired()
    if not ok:
        pytest.skip(f"`pdserve router --help` fails ({why.strip()}): router not wired yet")
    from services.models.default_model import cache_root

    # The compose file as `docker compose up` would see it, with PDSERVE_API_KEY set.
    doc = compose.load(env={"PDSERVE_API_KEY": API_KEY})
    # model-cache -> this machine's cache, where default_model_dir already converted it
    plan = compose.LocalPlan(doc, PDSERVE, volumes={"model-cache": cache_root()})
    log_dir = tmp_path_factory.mktemp("compose-logs")
    running: dict[str, Running] = {}
    try:
        for wave in plan.start_order():
            for name in wave:
                svc = plan.services[name]
                for dep, condition in svc.depends_on.items():
                    assert condition == "service_healthy", (name, dep, condition)
                running[name] = Running(svc, log_dir)
            _wait_healthy([running[n] for n in wave], timeout=240)
        yield plan, running
    finally:
        for r in reversed(list(running.values())):
            r.stop()


def test_plan_maps_every_port_and_name():
    doc = compose.load(env={})
    plan = compose.LocalPlan(doc, PDSERVE, volumes={"model-cache": Path("/tmp/cache")})
    for svc in plan.services.values():
        text = " ".join(svc.command + (svc.healthcheck or []) + list(svc.env.values()))
        for other in plan.services:
            assert f"{other}:" not in text, f"{svc.name}: unmapped address in {text}"
        assert "0.0.0.0" not in text and "/var/cache/pdserve" not in text
        assert "/opt/pdserve/" not in text, "healthcheck script is not COPYed by the Dockerfile"
        assert svc.command[:2] == [PDSERVE, svc.name]
    assert plan.start_order() == [["decode", "prefill"], ["router"]]


def test_chat_through_compose_services(stack):
    from openai import OpenAI

    plan, running = stack
    router_port = plan.services["router"].ports[8000]
    base = f"http://127.0.0.1:{router_port}"
    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content, resp
    assert resp.usage.completion_tokens > 0

    # the docs' curl example: the default model by name, a plain JSON POST
    body = json.dumps(
        {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    assert answer["model"] == "smollm2-135m"
    assert "Paris" in answer["choices"][0]["message"]["content"]

    # the router's API key (from the compose environment) is enforced
    with pytest.raises(Exception) as err:
        OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert getattr(err.value, "status_code", None) == 401

    # the workers' Prometheus endpoints on their compose --metrics-port
    for role in ("prefill", "decode"):
        port = plan.services[role].ports[9090]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"# TYPE" in r.read()
    # the image's own HEALTHCHECK (no arguments: it finds the pdserve process and its
    # role) agrees, for each service
    instrs = dict(compose.dockerfile_stages()[-1][1])
    hc = json.loads(instrs["HEALTHCHECK"].split("CMD", 1)[1])
    assert hc[0] == "python"
    hc = [sys.executable, *(str(plan.copies.get(a, a)) for a in hc[1:])]
    for r in running.values():
        env = {**os.environ, "PDSERVE_HEALTHCHECK_PID": str(r.proc.pid)}
        check = subprocess.run(hc, capture_output=True, text=True, timeout=30, env=env)
        assert check.returncode == 0, (r.service.name, check.stderr)
        assert r.proc.poll() is None, f"{r.service.name} died:\n{r.tail()}"
