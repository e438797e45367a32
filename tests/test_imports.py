"""The import directions of docs/architecture.md, read from the source: every import
statement (module level and inside functions) of the first-party packages.

  pdserve -> router, services          (the entry point sits above both)
  router -> pdpb                       (no torch, no engine, no transfer engine)
  kvtransfer -> nothing first-party    (block ids and addresses only)
  services/{prefill,decode,common} -> services/engine, kvtransfer, pdpb
  services/engine -> services/models -> services/kernels   (no gRPC, HTTP or protobuf)
and no import cycle anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "router", "services", "kvtransfer")
FIRST_PARTY = (*PACKAGES, "pdpb")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module `path` imports; `from a import b` counts as a.b when that is a
    module, else as a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, name, known) for name, path in mods.items()}


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    graph = _graph()
    assert "services.engine.llm_engine" in graph and "router.app" in graph
    assert "services.engine.scheduler" in graph["services.engine.llm_engine"]


def test_allowed_directions():
    rules = [
        # (importer prefix, forbidden import prefixes)
        ("router", ("services", "kvtransfer", "pdserve", "torch", "mooncake")),
        ("kvtransfer", ("services", "router", "pdserve", "pdpb", "torch", "grpc")),
        ("services", ("router", "pdserve", "aiohttp")),
        (
            "services.engine",
            ("grpc", "aiohttp", "google.protobuf", "pdpb", "kvtransfer")
            + ("services.common", "services.prefill", "services.decode"),
        ),
        ("services.models", ("services.engine", "services.common", "grpc", "pdpb")),
        ("services.kernels", ("services.engine", "services.models", "services.common", "grpc")),
    ]
    violations = [
        f"{mod} imports {imp}"
        for mod, imports in _graph().items()
        for prefix, forbidden in rules
        if _under(mod, prefix)
        for imp in imports
        if _under(imp, *forbidden)
    ]
    assert violations == []


def test_no_import_cycles():
    graph = _graph()
    edges = {m: {i for i in imps if i in graph and i != m} for m, imps in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert cycles == [], " | ".join(" -> ".join(c) for c in cycles)
