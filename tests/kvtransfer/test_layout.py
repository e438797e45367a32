"""Pure unit tests: layout validation, compatibility messages, coalescing, regions."""

from __future__ import annotations

import json
import random

import pytest

from kvtransfer import (
    BACKENDS,
    KVAgentInfo,
    KVLayout,
    KVLayoutMismatch,
    TransferStats,
    check_compatible,
    coalesce,
    create_connector,
)
from kvtransfer.layout import batched, kv_heads_of_rank, to_regions

SMOL = dict(num_blocks=100, block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


def test_block_bytes_from_dtype():
    assert KVLayout(**SMOL, dtype="bfloat16").block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert KVLayout(**SMOL, dtype="float32").block_bytes == 30 * 2 * 16 * 3 * 64 * 4
    lay = KVLayout(**SMOL, dtype="float16")
    assert lay.total_bytes == 100 * lay.block_bytes
    assert KVLayout(**SMOL, dtype="torch.bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize(
    "change",
    [
        {"num_blocks": 0},
        {"block_size": -1},
        {"num_layers": 1.5},
        {"head_dim": True},
        {"num_kv_heads": "3"},
        {"dtype": "float128"},
        {"dtype": 4},
        {"layout": "layer_major"},
        {"layout": "block_major"},  # the old heads-innermost layout: other byte order
        {"tp_size": 0},
        {"tp_rank": -1},
        {"total_kv_heads": -3},
    ],
)
def test_layout_rejects_bad_fields(change):
    with pytest.raises(ValueError):
        KVLayout(**{**SMOL, **change})


def test_layout_dict_roundtrip_ignores_unknown_keys():
    lay = KVLayout(**SMOL, dtype="float16")
    data = json.loads(json.dumps(lay.to_dict()))
    assert KVLayout.from_dict({**data, "future_field": 1}) == lay
    with pytest.raises(ValueError):
        KVLayout.from_dict({"num_blocks": 1})


def test_compatible_layouts_may_differ_in_num_blocks():
    check_compatible(KVLayout(**SMOL), KVLayout(**{**SMOL, "num_blocks": 7}))


def test_mismatch_names_every_differing_field():
    local = KVLayout(**SMOL, dtype="bfloat16")
    remote = KVLayout(
        num_blocks=5, block_size=32, num_layers=30, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(local, remote)
    assert set(err.value.fields) == {"block_size", "dtype", "total_kv_heads", "head_dim"}
    msg = str(err.value)
    for name in ("block_size", "dtype", "total_kv_heads", "head_dim"):
        assert name in msg
    assert "num_layers" not in msg and "num_blocks" not in msg
    assert "local=16 remote=32" in msg
    assert isinstance(err.value, ValueError)


def test_mismatch_num_layers_alone():
    with pytest.raises(KVLayoutMismatch, match="num_layers: local=30 remote=31"):
        check_compatible(KVLayout(**SMOL), KVLayout(**{**SMOL, "num_layers": 31}))


def test_coalesce_runs():
    src = [0, 1, 2, 7, 8, 20, 3]
    dst = [10, 11, 12, 13, 14, 40, 30]
    assert coalesce(src, dst) == [(0, 10, 3), (7, 13, 2), (3, 30, 1), (20, 40, 1)]
    assert coalesce([], []) == []
    assert coalesce(range(100), range(5, 105)) == [(0, 5, 100)]


def test_coalesce_unsorted_and_shared_sources_are_minimal():
    # a source block sent to two destinations on two diagonals: two runs, not four
    assert coalesce([0, 0, 1, 1], [0, 5, 1, 6]) == [(0, 0, 2), (0, 5, 2)]
    ids = list(range(50))
    random.Random(0).shuffle(ids)
    assert coalesce(ids, [i + 3 for i in ids]) == [(0, 3, 50)]


def test_coalesce_covers_every_pair_exactly():
    rng = random.Random(1)
    dst = rng.sample(range(1000), 300)
    src = [rng.randrange(200) for _ in dst]
    pairs = sorted((s + k, d + k) for s, d, n in coalesce(src, dst) for k in range(n))
    assert pairs == sorted(zip(src, dst))


@pytest.mark.parametrize(
    "src,dst,match",
    [
        ([1, 2], [1], "2 block ids but dst has 1"),
        ([-1], [0], ">= 0"),
        ([0], [-3], ">= 0"),
        ([0, 1], [4, 4], r"duplicate dst block ids: \[4\]"),
        ([0.0], [1], "must be an int"),
    ],
)
def test_coalesce_validates(src, dst, match):
    with pytest.raises(ValueError, match=match):
        coalesce(src, dst)


def test_to_regions_splits_large_runs():
    regions = to_regions([(2, 5, 3), (10, 0, 1)], 1000, 50_000, 100, 120)
    assert regions == [
        (1200, 50_500, 120),
        (1320, 50_620, 120),
        (1440, 50_740, 60),
        (2000, 50_000, 100),
    ]
    assert sum(r[2] for r in regions) == 400
    assert to_regions([(0, 0, 4)], 0, 0, 100, 1 << 20) == [(0, 0, 400)]
    assert [len(b) for b in batched(list(range(1030)), 512)] == [512, 512, 6]


def test_agent_info_json_roundtrip_and_validation():
    lay = KVLayout(**SMOL)
    info = KVAgentInfo("10.0.0.1:15123", 0x7F00_0000_1000, lay, "mooncake", "tcp")
    assert KVAgentInfo.from_json(info.to_json()) == info
    assert KVAgentInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert info.host == "10.0.0.1" and info.port == 15123
    assert KVAgentInfo.from_dict({**info.to_dict(), "base_addr": str(info.base_addr)}) == info
    for bad in ("nohost", "host:", ":123", "h:0", "h:70000", "h:12a"):
        with pytest.raises(ValueError):
            KVAgentInfo(bad, 4096, lay)
    with pytest.raises(ValueError):
        KVAgentInfo("h:1", 0, lay)
    with pytest.raises(ValueError):
        KVAgentInfo("h:1", 4096, lay.to_dict())
    with pytest.raises(ValueError):
        KVAgentInfo.from_dict({"session_id": "h:1"})


def test_transfer_stats_gbps():
    assert TransferStats(2_000_000_000, 1, 1, 1, 2.0).gbps == 1.0
    assert TransferStats(0, 0, 0, 0, 0.0).gbps == 0.0


def test_create_connector_unknown_backends():
    with pytest.raises(ValueError, match="known: mooncake"):
        create_connector("nixl")
    with pytest.raises(ValueError, match="ROCm"):
        create_connector("mori")
    assert "mori" in BACKENDS


def test_package_never_imports_torch_or_engine():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, kvtransfer, kvtransfer.mooncake; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('services')]; "
        "assert not bad, bad"
    )
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


# ---- FP8 KV: the dtype and per-layer scales are part of the layout --------------------

FP8 = dict(SMOL, dtype="float8_e4m3fn", k_scales=[1.0] * 30, v_scales=[0.5] * 30)


def test_fp8_layout_moves_half_the_bytes_of_bf16_and_round_trips_its_scales():
    lay = KVLayout(**FP8)
    assert lay.block_bytes * 2 == KVLayout(**SMOL, dtype="bfloat16").block_bytes
    assert lay.k_scales == (1.0,) * 30 and isinstance(lay.v_scales, tuple)
    assert KVLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    # and through the protobuf the workers exchange
    from services.common import convert

    info = KVAgentInfo(session_id="127.0.0.1:1234", base_addr=4096, layout=lay)
    assert convert.agent_from_pb(convert.agent_to_pb(info)).layout == lay


@pytest.mark.parametrize(
    "change,error",
    [
        ({"k_scales": [1.0] * 29}, "k_scales has 29 entries for 30 layers"),
        ({"v_scales": [1.0] * 29 + [0.0]}, "positive finite"),
        ({"v_scales": [1.0] * 29 + [float("nan")]}, "positive finite"),
        ({"k_scales": "1.0"}, "sequence of floats"),
        ({"v_scales": []}, "given together"),
    ],
)
def test_bad_scales_are_refused(change, error):
    with pytest.raises(ValueError, match=error):
        KVLayout(**{**FP8, **change})


def test_kv_dtype_and_scale_mismatches_are_named():
    fp8 = KVLayout(**FP8)
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(fp8, KVLayout(**SMOL, dtype="bfloat16"))
    assert set(err.value.fields) == {"dtype", "k_scales", "v_scales"}
    assert "dtype: local='float8_e4m3fn' remote='bfloat16'" in str(err.value)
    assert "k_scales: local has 30, remote none" in str(err.value)
    other = KVLayout(**{**FP8, "v_scales": [0.5] * 7 + [0.25] + [0.5] * 22})
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(fp8, other)
    assert err.value.fields == ("v_scales",)
    assert "v_scales: layer 7 local=0.5 remote=0.25" in str(err.value)


# ---- tensor parallelism: which KV heads a rank holds ----------------------------------


@pytest.mark.parametrize(
    "total,tp,expected",
    [
        (8, 1, [range(0, 8)]),
        (8, 2, [range(0, 4), range(4, 8)]),
        (4, 4, [range(i, i + 1) for i in range(4)]),
        # more ranks than heads: each head replicated on consecutive ranks
        (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
        (1, 3, [range(0, 1)] * 3),
    ],
)
def test_kv_heads_of_rank(total, tp, expected):
    assert [kv_heads_of_rank(total, tp, r) for r in range(tp)] == expected


@pytest.mark.parametrize(
    "total,tp,match",
    [
        (6, 4, "total_kv_heads 6 is not divisible by tp_size 4"),
        (3, 2, "total_kv_heads 3 is not divisible by tp_size 2"),
        (3, 4, "tp_size 4 is not a multiple of total_kv_heads 3"),
        (0, 1, "total_kv_heads must be >= 1"),
    ],
)
def test_kv_heads_of_rank_refuses_impossible_pairs(total, tp, match):
    with pytest.raises(ValueError, match=match):
        kv_heads_of_rank(total, tp, 0)


def tp_layout(tp_size: int, tp_rank: int, total: int = 4, **kw) -> KVLayout:
    heads = len(kv_heads_of_rank(total, tp_size, tp_rank))
    base = {**SMOL, "num_kv_heads": heads, **kw}
    return KVLayout(**base, tp_size=tp_size, tp_rank=tp_rank, total_kv_heads=total)


def test_tp_layout_fields_and_sizes():
    lay = tp_layout(2, 1, total=8)
    assert lay.kv_heads == range(4, 8) and lay.num_kv_heads == 4
    assert lay.head_bytes == 30 * 2 * 16 * 64 * 2
    assert lay.block_bytes == 4 * lay.head_bytes
    single = KVLayout(**SMOL)  # total_kv_heads 0 means num_kv_heads: no TP
    assert (single.tp_size, single.tp_rank, single.total_kv_heads) == (1, 0, 3)
    assert single.kv_heads == range(3) and single.layout == "block_head_major"


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(num_kv_heads=2, tp_size=2, tp_rank=2, total_kv_heads=4),
            "tp_rank 2 must be < tp_size 2",
        ),
        (
            dict(num_kv_heads=4, tp_size=2, tp_rank=1, total_kv_heads=4),
            "num_kv_heads 4 does not match the 2 heads that tp_rank 1 of tp_size 2",
        ),
        (dict(num_kv_heads=2, tp_size=2, tp_rank=0), "num_kv_heads 2 does not match the 1 heads"),
        (dict(num_kv_heads=1, tp_size=3, total_kv_heads=2), "tp_size 3 is not a multiple"),
    ],
)
def test_tp_layout_validation_names_the_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**SMOL, **kw})


def test_compatible_across_tp_degrees():
    # a TP=2 rank and a single rank hold different head counts of the same model
    check_compatible(tp_layout(2, 1), tp_layout(1, 0, num_blocks=7))
    check_compatible(tp_layout(4, 3, total=2), tp_layout(1, 0, total=2))


def test_tp_mismatches_are_named():
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(tp_layout(2, 0, total=4), tp_layout(2, 0, total=8))
    assert err.value.fields == ("total_kv_heads",)
    assert "total_kv_heads: local=4 remote=8" in str(err.value)
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(tp_layout(2, 0), tp_layout(4, 1, head_dim=128, dtype="float16"))
    assert set(err.value.fields) == {"head_dim", "dtype"}
    assert "head_dim: local=64 remote=128" in str(err.value)


def test_tp_layout_dict_roundtrip_and_old_dicts():
    lay = tp_layout(4, 3, total=8)
    data = json.loads(json.dumps(lay.to_dict()))
    assert (data["tp_size"], data["tp_rank"], data["total_kv_heads"]) == (4, 3, 8)
    assert KVLayout.from_dict(data) == lay
    # a peer that predates TP sends no TP keys: one rank holding every head
    old = {
        k: v for k, v in KVLayout(**SMOL).to_dict().items() if not k.startswith(("tp_", "total"))
    }
    assert KVLayout.from_dict(old) == KVLayout(**SMOL, tp_size=1, tp_rank=0, total_kv_heads=3)
