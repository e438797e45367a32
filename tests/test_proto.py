"""The committed generated code must match the .proto files (`make proto`), and the
package's dependency floors must admit only runtimes that code accepts."""

import re
import tomllib
from pathlib import Path

from scripts import gen_proto

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh():
    stale = gen_proto.check()
    assert not stale, f"stale generated files, run `make proto`: {stale}"


def _floor(deps: list[str], name: str) -> tuple[int, ...]:
    spec = next(d for d in deps if re.match(rf"{re.escape(name)}\s*>=", d))
    return tuple(int(p) for p in spec.split(">=")[1].split(",")[0].strip().split("."))


def test_dependency_floors_admit_only_runtimes_the_stubs_accept():
    """The stubs refuse, at import, a grpcio older than the grpcio-tools that generated
    them and a protobuf older than their gencode: pyproject's floors must be no lower
    (grpcio 1.85.0 passed `grpcio>=1.85` and then failed at import)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    stub = (ROOT / "proto/pdpb/v1/decode_pb2_grpc.py").read_text()
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", stub).group(1)
    gencode = (ROOT / "proto/pdpb/v1/decode_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", gencode)
    grpc_need = tuple(int(p) for p in grpc_gen.split("."))
    assert _floor(deps, "grpcio") >= grpc_need, grpc_gen
    assert _floor(deps, "grpcio-health-checking") >= grpc_need, grpc_gen
    assert _floor(deps, "protobuf") >= tuple(int(g) for g in m.groups()), m.groups()


def test_enums_start_with_unspecified():
    from pdpb.v1 import common_pb2

    for enum in common_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")


def test_kv_agent_tp_fields_round_trip():
    from kvtransfer import KVAgentInfo, KVLayout
    from services.common import convert

    layout = KVLayout(
        num_blocks=10,
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        tp_size=4,
        tp_rank=3,
        total_kv_heads=8,
    )
    info = KVAgentInfo("127.0.0.1:1234", 4096, layout)
    pb = convert.agent_to_pb(info)
    assert (pb.layout.tp_size, pb.layout.tp_rank, pb.layout.total_kv_heads) == (4, 3, 8)
    assert convert.agent_from_pb(pb) == info
    # a peer that predates TP leaves the fields unset (0): one rank, every head
    pb.layout.ClearField("tp_size")
    pb.layout.ClearField("tp_rank")
    pb.layout.ClearField("total_kv_heads")
    pb.layout.num_kv_heads = 8
    old = convert.agent_from_pb(pb).layout
    assert (old.tp_size, old.tp_rank, old.total_kv_heads) == (1, 0, 8)
