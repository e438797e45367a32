"""Read docker-compose files the way `docker compose` does (interpolation, override merge)
and turn each service into a local process: same command, same environment, with the
container world mapped onto this machine.

The mapping (nothing else is changed, so the compose wiring itself is what gets tested):
- `pdserve` (argv[0]) -> this venv's pdserve (or $PDSERVE_BIN), `python` -> this Python;
- files the Dockerfile COPYs into the image -> the same files in the checkout;
- each service's ports (its --port / --metrics-port flags, `expose`, `ports`) -> free
  local ports, and every `service:port` / `127.0.0.1:port` / URL that names them is
  rewritten to 127.0.0.1:<local port>; a bare service name (--transfer-hostname) ->
  127.0.0.1; --host 0.0.0.0 -> 127.0.0.1;
- named volumes -> local folders (the model cache -> this machine's pdserve cache).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
DOCKERFILE = ROOT / "Dockerfile"

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, ${VAR:+alt}, $VAR, $$
_VAR = re.compile(
    r"\$(?:(?P<escape>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value, env: dict[str, str]):
    """Compose variable interpolation, applied to every string in a loaded document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m["escape"]:
            return "$"
        name = m["braced"] or m["plain"]
        op, arg = m["op"], m["arg"] or ""
        current = env.get(name)
        unset_or_empty = not current
        missing = unset_or_empty if op and op.startswith(":") else current is None
        if op in (":-", "-"):
            return arg if missing else current
        if op in (":?", "?"):
            if missing:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return current
        if op in (":+", "+"):
            return "" if missing else arg
        return current or ""

    return _VAR.sub(sub, value)


def load(path: Path = COMPOSE_FILE, env: dict[str, str] | None = None) -> dict:
    """Load and interpolate one compose file (x- extension keys are dropped)."""
    doc = yaml.safe_load(path.read_text())
    doc = {k: v for k, v in doc.items() if not k.startswith("x-")}
    return interpolate(doc, dict(os.environ if env is None else env))


def _merge(base, override, key: str = ""):
    # The compose merge rules that matter here: mappings merge, `command` / `entrypoint`
    # / healthcheck `test` are replaced, sequences of ports / volumes / expose are appended.
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list):
        if key in ("ports", "expose", "volumes", "devices", "dns", "extra_hosts"):
            return base + [v for v in override if v not in base]
        return override
    return override


def load_merged(*paths: Path, env: dict[str, str] | None = None) -> dict:
    """`docker compose -f a -f b config`, for the keys this project uses."""
    merged: dict = {}
    for path in paths:
        merged = _merge(merged, load(path, env))
    return merged


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


def dockerfile_stages(dockerfile: Path = DOCKERFILE) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(stage name, [(INSTRUCTION, rest of the line)])], continuation lines joined; the
    first entry, "(global)", holds the ARGs before the first FROM."""
    lines, buf = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    stages: list[tuple[str, list[tuple[str, str]]]] = [("(global)", [])]  # ARGs before FROM
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            parts = rest.split()
            stage = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else ""
            stages.append((stage, []))
        stages[-1][1].append((instr, rest.strip()))
    return stages


def dockerfile_copies(dockerfile: Path = DOCKERFILE) -> dict[str, Path]:
    """Container path -> checkout path for the single-file COPY lines of the Dockerfile."""
    copies = {}
    for line in dockerfile.read_text().splitlines():
        parts = shlex.split(line) if line.startswith("COPY ") else []
        args = [p for p in parts[1:] if not p.startswith("--")]
        if len(args) == 2 and (ROOT / args[0]).is_file():
            copies[args[1]] = ROOT / args[0]
    return copies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _container_port(spec) -> int:
    """The container side of a `ports` / `expose` entry ("8000", "8080:8000", 8000)."""
    if isinstance(spec, dict):
        return int(spec["target"])
    return int(str(spec).split(":")[-1].split("/")[0])


@dataclass
class LocalService:
    name: str
    command: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None
    ports: dict[int, int]  # container port -> local port
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition


class LocalPlan:
    """Every service of a compose file, mapped to local processes."""

    def __init__(self, compose: dict, pdserve: str, volumes: dict[str, Path]):
        self.compose = compose
        self.services_doc: dict = compose["services"]
        self.pdserve = pdserve
        self.copies = dockerfile_copies()
        self.ports: dict[str, dict[int, int]] = {}
        for name, svc in self.services_doc.items():
            found = set(self._flag_ports(svc.get("command") or []))
            found |= {_container_port(p) for p in svc.get("expose") or []}
            found |= {_container_port(p) for p in svc.get("ports") or []}
            self.ports[name] = {p: free_port() for p in sorted(found)}
        self.volume_dirs = volumes
        self.services = {name: self._service(name) for name in self.services_doc}

    @staticmethod
    def _flag_ports(command: list[str]):
        for flag, value in zip(command, command[1:]):
            if flag in ("--port", "--metrics-port") and value.isdigit() and int(value) > 0:
                yield int(value)

    def _mounts(self, name: str) -> list[tuple[str, Path]]:
        """(container path, local folder) for the service's named volumes."""
        mounts = []
        for spec in self.services_doc[name].get("volumes") or []:
            if isinstance(spec, dict):
                source, target = spec.get("source"), spec["target"]
            else:
                source, target = str(spec).split(":")[:2]
            if source in self.volume_dirs:
                mounts.append((target, self.volume_dirs[source]))
        return mounts

    def _rewrite(self, name: str, token: str, previous: str | None) -> str:
        own = self.ports[name]
        if previous in ("--port", "--metrics-port") and token.isdigit() and int(token) in own:
            return str(own[int(token)])
        if previous == "--host" and token in ("0.0.0.0", "::"):
            return "127.0.0.1"
        if token in self.services_doc and (previous or "").startswith("--"):
            # a flag's value that is a host name: --transfer-hostname prefill
            return "127.0.0.1"
        if token in self.copies:
            return str(self.copies[token])
        for target, local in self._mounts(name):
            if token == target or token.startswith(target.rstrip("/") + "/"):
                return str(local) + token[len(target.rstrip("/")) :]

        def address(m: re.Match) -> str:
            host, port = m["host"], int(m["port"])
            if host in self.services_doc and port in self.ports[host]:
                return f"127.0.0.1:{self.ports[host][port]}"
            if host in ("127.0.0.1", "localhost", "0.0.0.0") and port in own:
                return f"127.0.0.1:{own[port]}"
            return m.group(0)  # not a service address (cuda:0, ...)

        return re.sub(r"(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)\b", address, token)

    def _argv(self, name: str, argv: list[str]) -> list[str]:
        out = []
        for i, token in enumerate(argv):
            if i == 0 and token == "pdserve":
                out.append(self.pdserve)
            elif i == 0 and token in ("python", "python3"):
                out.append(sys.executable)
            else:
                out.append(self._rewrite(name, token, argv[i - 1] if i else None))
        return out

    def _service(self, name: str) -> LocalService:
        svc = self.services_doc[name]
        command = svc["command"]
        assert isinstance(command, list), f"{name}: use the exec (list) form of command"
        env = {k: self._rewrite(name, v, None) for k, v in environment(svc).items()}
        health = None
        if svc.get("healthcheck"):
            test = svc["healthcheck"]["test"]
            assert test[0] == "CMD", f"{name}: healthcheck must use the CMD form"
            health = self._argv(name, test[1:])
        depends = svc.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: "service_started" for d in depends}
        else:
            depends = {d: spec.get("condition", "service_started") for d, spec in depends.items()}
        return LocalService(
            name=name,
            command=self._argv(name, command),
            env=env,
            healthcheck=health,
            ports=self.ports[name],
            depends_on=depends,
        )

    def start_order(self) -> list[list[str]]:
        """Services in waves: each wave depends only on earlier waves."""
        done: set[str] = set()
        waves = []
        while len(done) < len(self.services):
            wave = [
                n for n, s in self.services.items() if n not in done and set(s.depends_on) <= done
            ]
            assert wave, f"depends_on cycle among {set(self.services) - done}"
            waves.append(sorted(wave))
            done |= set(wave)
        return waves
