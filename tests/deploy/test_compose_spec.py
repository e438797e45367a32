"""docker-compose.yml and docker-compose.gpu.yml without a Docker engine: valid against
the compose specification (check-jsonschema's vendored compose-spec schema), and wired
the way the issue asks (healthchecks, depends_on service_healthy, one published port,
a named model cache volume, commands that pdserve's own parser accepts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy import compose

pytest.importorskip("check_jsonschema", reason="pip install check-jsonschema")

WORKERS = {"prefill": 50061, "decode": 50071}


def _check_jsonschema(*paths) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
        + [str(p) for p in paths],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_files_match_the_compose_spec():
    proc = _check_jsonschema(compose.COMPOSE_FILE, compose.GPU_OVERRIDE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_validator_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    text = compose.COMPOSE_FILE.read_text().replace(
        "condition: service_healthy", "condition: service_ready", 1
    )
    bad.write_text(text)
    proc = _check_jsonschema(bad)
    assert proc.returncode != 0 and "service_ready" in proc.stdout


def _parse(command: list[str]):
    from pdserve.cli import build_parser

    assert command[0] == "pdserve"
    return build_parser().parse_args(command[1:])


def test_services_wiring():
    doc = compose.load(env={})
    services = doc["services"]
    assert set(services) == {"router", "prefill", "decode"}
    images = {s["image"] for s in services.values()}
    assert images == {"pdserve:0.1.0"}, "one image, never :latest"
    assert all(s["build"]["context"] == "." for s in services.values())

    # only the router publishes a port
    assert [n for n, s in services.items() if s.get("ports")] == ["router"]
    assert services["router"]["ports"] == ["8000:8000"]

    cache_volume = "model-cache"
    assert cache_volume in doc["volumes"]
    for role, port in WORKERS.items():
        svc = services[role]
        args = _parse(svc["command"])
        assert args.command == role and args.port == port and args.host == "0.0.0.0"
        assert args.device == "cpu" and args.model == "smollm2-135m"
        assert args.transfer_protocol == "tcp"
        assert args.transfer_hostname == role, "peers reach the transfer engine by name"
        assert args.metrics_port and str(args.metrics_port) in svc["expose"]
        assert str(port) in svc["expose"]
        env = compose.environment(svc)
        assert f"{cache_volume}:{env['PDSERVE_CACHE_DIR']}" in svc["volumes"]
        hc = svc["healthcheck"]
        assert hc["test"] == [
            "CMD",
            "python",
            "/opt/pdserve/healthcheck.py",
            "grpc",
            f"127.0.0.1:{port}",
        ]
        assert hc["start_period"] in ("300s", "5m")  # model load
    assert _parse(services["decode"]["command"]).prefill_failure_policy == "recompute"

    router = services["router"]
    args = _parse(router["command"])
    assert args.command == "router" and args.port == 8000 and args.host == "0.0.0.0"
    assert args.prefill == ["prefill:50061"] and args.decode == ["decode:50071"]
    assert router["depends_on"] == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    assert router["healthcheck"]["test"][-2:] == ["http", "http://127.0.0.1:8000/ready"]
    assert compose.environment(router)["PDSERVE_API_KEY"] == ""


def test_variables_override_defaults():
    env = {"PDSERVE_PORT": "9000", "PDSERVE_MODEL": "/models/m", "PDSERVE_API_KEY": "k"}
    doc = compose.load(env=env)
    assert doc["services"]["router"]["ports"] == ["9000:8000"]
    assert compose.environment(doc["services"]["router"])["PDSERVE_API_KEY"] == "k"
    assert _parse(doc["services"]["decode"]["command"]).model == "/models/m"


def test_gpu_override():
    doc = compose.load_merged(compose.COMPOSE_FILE, compose.GPU_OVERRIDE, env={})
    services = doc["services"]
    assert {s["image"] for s in services.values()} == {"pdserve:0.1.0-cuda13"}
    assert [n for n, s in services.items() if s.get("ports")] == ["router"]
    gpus = {}
    for role, port in WORKERS.items():
        svc = services[role]
        args = _parse(svc["command"])
        assert args.port == port and args.transfer_hostname == role
        assert args.transfer_protocol == "nvlink_intra"
        assert args.device.startswith("cuda:") and args.tensor_parallel_size == 1
        gpus[role] = args.device
        assert compose.environment(svc)["MC_INTRANODE_NVLINK"] == "1"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert svc["ipc"] == "host"
        # kept from the base file: healthcheck, cache volume, CPU-side env
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
        assert compose.environment(svc)["PDSERVE_CACHE_DIR"] == "/var/cache/pdserve"
        # compiled Triton kernels persist on the mounted cache volume
        cache_mounts = [v for v in svc["volumes"] if str(v).endswith(":/var/cache/pdserve")]
        assert cache_mounts and compose.environment(svc)["TRITON_CACHE_DIR"].startswith(
            "/var/cache/pdserve/"
        )
        args_declared = {
            rest.split("=")[0]
            for _, instrs in compose.dockerfile_stages()
            for instr, rest in instrs
            if instr == "ARG"
        }
        assert set(svc["build"]["args"]) <= args_declared
    assert gpus == {"prefill": "cuda:0", "decode": "cuda:1"}
    one_gpu = compose.load_merged(
        compose.COMPOSE_FILE,
        compose.GPU_OVERRIDE,
        env={"PDSERVE_PREFILL_GPU": "0", "PDSERVE_DECODE_GPU": "0"},
    )
    assert _parse(one_gpu["services"]["decode"]["command"]).device == "cuda:0"


def test_gpu_override_tensor_parallel():
    """PDSERVE_PREFILL_TP / PDSERVE_DECODE_TP reach --tensor-parallel-size; the header's
    4-GPU example gives the two workers disjoint GPU ranges (as `pdserve up` reckons
    them), all visible to both (count: all) for NVLink."""
    from pdserve.launcher import gpu_range

    env = {"PDSERVE_PREFILL_TP": "2", "PDSERVE_DECODE_TP": "2", "PDSERVE_DECODE_GPU": "2"}
    assert "PDSERVE_PREFILL_TP=2 PDSERVE_DECODE_TP=2 PDSERVE_DECODE_GPU=2" in (
        compose.GPU_OVERRIDE.read_text()
    )
    doc = compose.load_merged(compose.COMPOSE_FILE, compose.GPU_OVERRIDE, env=env)
    ranges = {}
    for role in WORKERS:
        svc = doc["services"][role]
        args = _parse(svc["command"])
        assert args.tensor_parallel_size == 2
        ranges[role] = set(gpu_range(args.device, args.tensor_parallel_size))
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["count"] == "all" and svc["ipc"] == "host"  # NCCL's /dev/shm too
    assert ranges == {"prefill": {0, 1}, "decode": {2, 3}}
