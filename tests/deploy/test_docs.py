"""docs/deployment.md documents every flag of the three services (and `pdserve up`) and
every environment variable the code reads, so the reference tables cannot rot."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.deploy.compose import ROOT

DOC = ROOT / "docs" / "deployment.md"
_ENV_PATTERNS = [
    r"os\.environ\.get\(\s*\"([A-Z][A-Z0-9_]+)\"",
    r"os\.environ\[\s*\"([A-Z][A-Z0-9_]+)\"\s*\]",
    r"\"([A-Z][A-Z0-9_]+)\"\s+(?:not\s+)?in\s+os\.environ",
    r"_ENV\s*=\s*\"([A-Z][A-Z0-9_]+)\"",
]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from pdserve.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "up", "tune-kernels"])
def test_every_flag_is_documented(command):
    parsers = _subcommands()
    if command not in parsers:
        pytest.skip(f"`pdserve {command}` does not exist yet")
    text = DOC.read_text()
    missing = [
        opt
        for action in parsers[command]._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help" and f"`{opt}`" not in text
    ]
    assert missing == [], f"pdserve {command}: flags missing from {DOC.name}"


def test_every_environment_variable_is_documented():
    text = DOC.read_text()
    found = set()
    for folder in ("pdserve", "services", "router", "kvtransfer"):
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text(errors="replace")
            for pattern in _ENV_PATTERNS:
                found |= set(re.findall(pattern, source))
    assert {"PDSERVE_CACHE_DIR", "PDSERVE_API_KEY", "MC_INTRANODE_NVLINK"} <= found
    missing = sorted(v for v in found if f"`{v}`" not in text)
    assert missing == [], f"environment variables missing from {DOC.name}"
