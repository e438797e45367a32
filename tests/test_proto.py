"""The committed generated code must match the .proto files (`make proto`)."""

from scripts import gen_proto


def test_generated_code_is_fresh():
    stale = gen_proto.check()
    assert not stale, f"stale generated files, run `make proto`: {stale}"


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
