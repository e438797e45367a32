"""docker/healthcheck.py, the image's HEALTHCHECK and the compose healthchecks: explicit
gRPC / HTTP modes against real servers, and the role-agnostic auto mode."""

from __future__ import annotations

import http.server
import importlib.util
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.compose import ROOT

SCRIPT = ROOT / "docker" / "healthcheck.py"
spec = importlib.util.spec_from_file_location("pdserve_healthcheck", SCRIPT)
healthcheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(healthcheck)


def run(*args: str, env: dict | None = None) -> int:
    import os

    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    ).returncode


@pytest.mark.parametrize(
    "argv,target",
    [
        (["tini", "--", "pdserve", "prefill", "--port", "50061"], ("grpc", "127.0.0.1:50061")),
        (["/opt/venv/bin/pdserve", "decode", "--model", "m"], ("grpc", "127.0.0.1:50071")),
        (["python", "/x/bin/pdserve", "decode", "--port=6000"], ("grpc", "127.0.0.1:6000")),
        (["pdserve", "router", "--port", "9000"], ("http", "http://127.0.0.1:9000/ready")),
        (["pdserve", "up", "--host", "0.0.0.0"], ("http", "http://127.0.0.1:8000/ready")),
        (["python", "-m", "router", "--port", "8001"], ("http", "http://127.0.0.1:8001/ready")),
        (["python", "-m", "pdserve", "prefill"], ("grpc", "127.0.0.1:50061")),
        (["pdserve", "chat"], None),
        (["sleep", "10"], None),
    ],
)
def test_target_from_cmdline(argv, target):
    assert healthcheck.target_from_cmdline(argv) == target


@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(0)


def test_grpc_mode(grpc_health_server):
    port, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # model still loading
    assert run("grpc", f"127.0.0.1:{port}") == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run("grpc", f"127.0.0.1:{port}") == 0
    server_gone = healthcheck.check_grpc("127.0.0.1:1")
    assert server_gone is False


@pytest.fixture
def http_server():
    state = {"status": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(state["status"] if self.path == "/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], state
    server.shutdown()


def test_http_mode(http_server):
    port, state = http_server
    url = f"http://127.0.0.1:{port}/ready"
    assert run("http", url) == 1
    state["status"] = 200
    assert run("http", url) == 0
    assert run("http", f"http://127.0.0.1:{port}/nope") == 1


def test_auto_mode_follows_the_process(grpc_health_server):
    """No arguments (the Dockerfile HEALTHCHECK): find the pdserve process, check its role."""
    port, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    # a process whose command line reads `... pdserve prefill --port N`
    fake = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "pdserve",
            "prefill",
            "--port",
            str(port),
        ]
    )
    try:
        assert run(env={"PDSERVE_HEALTHCHECK_PID": str(fake.pid)}) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run(env={"PDSERVE_HEALTHCHECK_PID": str(fake.pid)}) == 1
    finally:
        fake.kill()
        fake.wait()


def test_usage_errors():
    assert run("grpc") == 2
    assert run("ftp", "x") == 2


def test_grpc_mode_over_mutual_tls(tmp_path):
    """The Helm chart's worker probes with tls.enabled: healthcheck.py over mutual TLS,
    its files and the name to expect from PDSERVE_HEALTHCHECK_TLS_*."""
    from tests.pki import SERVER_NAME, make_pki

    pki = make_pki(tmp_path)

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [(read(pki.named.key), read(pki.named.cert))],
        root_certificates=read(pki.ca),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    address = f"127.0.0.1:{port}"
    env = {
        "PDSERVE_HEALTHCHECK_TLS_CA_FILE": pki.ca,
        "PDSERVE_HEALTHCHECK_TLS_CERT_FILE": pki.named.cert,
        "PDSERVE_HEALTHCHECK_TLS_KEY_FILE": pki.named.key,
        "PDSERVE_HEALTHCHECK_TLS_SERVER_NAME": SERVER_NAME,
    }
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run("grpc", address, env=env) == 0
        assert run("grpc", address) == 1  # plaintext: refused
        no_name = {k: v for k, v in env.items() if not k.endswith("SERVER_NAME")}
        assert run("grpc", address, env=no_name) == 1  # the certificate names no IP
        no_cert = {k: v for k, v in env.items() if "CERT" not in k and "KEY" not in k}
        assert run("grpc", address, env=no_cert) == 1  # mutual TLS: no client certificate
        missing = {**env, "PDSERVE_HEALTHCHECK_TLS_CA_FILE": str(tmp_path / "nope")}
        assert run("grpc", address, env=missing) == 1
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run("grpc", address, env=env) == 1
    finally:
        server.stop(0)
