"""Container health check for the pdserve image (Docker HEALTHCHECK, compose healthcheck).

    healthcheck.py grpc HOST:PORT [SERVICE]   grpc.health.v1 Check; healthy when SERVING
    healthcheck.py http URL                   HTTP GET; healthy on a 2xx answer
    healthcheck.py                            auto: find the container's pdserve process
                                              (lowest PID, or $PDSERVE_HEALTHCHECK_PID) and
                                              check it the way its role needs

Auto mode reads `pdserve <role> ... --port N` from the process command line: prefill and
decode workers get a gRPC health check on N (defaults 50061 / 50071), `router` and `up`
an HTTP check of /ready on N (default 8000). Exit status 0 = healthy, 1 = unhealthy.
Standard library + grpcio only, so it runs in the router image (no torch) too.

Workers serving TLS (--tls-cert-file) are checked over TLS when these are set (the Helm
chart sets them with tls.enabled; kubelet's own gRPC probes cannot speak TLS):
PDSERVE_HEALTHCHECK_TLS_CA_FILE (verifies the worker), PDSERVE_HEALTHCHECK_TLS_CERT_FILE
and _KEY_FILE (the client certificate a mutual-TLS worker asks for),
PDSERVE_HEALTHCHECK_TLS_SERVER_NAME (the name in the worker's certificate, when it does
not name 127.0.0.1).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = float(os.environ.get("PDSERVE_HEALTHCHECK_TIMEOUT", "3"))
DEFAULT_PORTS = {"prefill": 50061, "decode": 50071, "router": 8000, "up": 8000}


def check_grpc(address: str, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with _channel(grpc, address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
    except grpc.RpcError as e:
        print(f"unhealthy: gRPC health of {address}: {e.code().name}", file=sys.stderr)
        return False
    except OSError as e:  # a TLS file
        print(f"unhealthy: {e}", file=sys.stderr)
        return False
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        print(f"unhealthy: {address} is {name}", file=sys.stderr)
        return False
    return True


def _channel(grpc, address: str):
    def env(name: str) -> str | None:
        return os.environ.get(f"PDSERVE_HEALTHCHECK_TLS_{name}") or None

    def read(name: str) -> bytes | None:
        if env(name) is None:
            return None
        with open(env(name), "rb") as f:
            return f.read()

    if env("CA_FILE") is None and env("CERT_FILE") is None:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(read("CA_FILE"), read("KEY_FILE"), read("CERT_FILE"))
    name = env("SERVER_NAME")
    return grpc.secure_channel(
        address, creds, [("grpc.ssl_target_name_override", name)] if name else []
    )


def check_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            ok = 200 <= resp.status < 300
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: GET {url}: {e}", file=sys.stderr)
        return False
    if not ok:
        print(f"unhealthy: GET {url}: status {resp.status}", file=sys.stderr)
    return ok


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def target_from_cmdline(argv: list[str]) -> tuple[str, str] | None:
    """("grpc", "127.0.0.1:PORT") or ("http", URL) for a pdserve command line, else None."""
    for i, arg in enumerate(argv):
        # the console script, or `python -m pdserve`
        is_pdserve = os.path.basename(arg) == "pdserve"
        is_module = arg == "router" and i >= 1 and argv[i - 1] == "-m"  # python -m router
        if not (is_pdserve or is_module):
            continue
        role = "router" if is_module else (argv[i + 1] if i + 1 < len(argv) else "")
        if role not in DEFAULT_PORTS:
            return None
        rest = argv[i + 1 :]
        port = int(_flag(rest, "--port") or DEFAULT_PORTS[role])
        if role in ("prefill", "decode"):
            return "grpc", f"127.0.0.1:{port}"
        return "http", f"http://127.0.0.1:{port}/ready"
    return None


def _cmdline(pid: str) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def auto_target() -> tuple[str, str] | None:
    pid = os.environ.get("PDSERVE_HEALTHCHECK_PID")
    if pid:
        return target_from_cmdline(_cmdline(pid))
    # PID 1 is pdserve itself or an init (tini) that started it: take the oldest pdserve
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for p in pids:
        try:
            target = target_from_cmdline(_cmdline(str(p)))
        except OSError:  # gone, or not ours to read
            continue
        if target:
            return target
    return None


def main(argv: list[str]) -> int:
    if not argv:
        target = auto_target()
        if target is None:
            print("healthcheck: no pdserve process found to check", file=sys.stderr)
            return 1
        kind, where = target
        return 0 if (check_grpc(where) if kind == "grpc" else check_http(where)) else 1
    kind, *rest = argv
    if kind == "grpc" and len(rest) in (1, 2):
        return 0 if check_grpc(*rest) else 1
    if kind == "http" and len(rest) == 1:
        return 0 if check_http(rest[0]) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
