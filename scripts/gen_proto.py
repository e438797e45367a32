"""Regenerate proto/pdpb/v1/*_pb2*.py from the .proto files (`make proto`).

`check()` regenerates into a temporary folder and compares, so a test can fail when
the committed code is stale."""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = PROTO_ROOT / "pdpb" / "v1"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PACKAGE.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "pdpb" / "v1").glob("*_pb2*.py*"))


def check() -> list[str]:
    """Names of generated files that differ from the committed ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh if not filecmp.cmp(f, PACKAGE / f.name, shallow=False)]
        committed = {p.name for p in PACKAGE.glob("*_pb2*.py*")}
        stale += sorted(committed - {f.name for f in fresh})
        return stale


def main() -> int:
    generate(PROTO_ROOT)
    print(f"generated into {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
