"""The committed generated code must match the .proto files (`make proto`)."""

from scripts import gen_proto


def test_generated_code_is_fresh():
    stale = gen_proto.check()
    assert not stale, f"stale generated files, run `make proto`: {stale}"


def test_enums_start_with_unspecified():
    from pdpb.v1 import common_pb2

    for enum in common_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
