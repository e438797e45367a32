"""Pure unit tests of the head-slice plan between TP ranks (no transfer engine)."""

from __future__ import annotations

import itertools

import pytest

from kvtransfer import KVLayout, KVLayoutMismatch
from kvtransfer.layout import kv_heads_of_rank
from kvtransfer.tp_plan import (
    block_chunks,
    check_tp_pair,
    chunk_regions,
    heads_to_write,
    is_whole_block,
    writer_rank,
)

# 1 KiB per head: 2 layers x (K,V) x 4 tokens x 16 dims x 4 bytes
DIMS = dict(block_size=4, num_layers=2, head_dim=16, dtype="float32")
HB = 1024


def rank(tp: int, r: int, total: int, num_blocks: int = 8) -> KVLayout:
    heads = len(kv_heads_of_rank(total, tp, r))
    return KVLayout(
        num_blocks=num_blocks,
        num_kv_heads=heads,
        tp_size=tp,
        tp_rank=r,
        total_kv_heads=total,
        **DIMS,
    )


def test_same_heads_move_whole_blocks():
    src, dst = rank(2, 1, 4), rank(2, 1, 4)
    chunks = block_chunks(src, dst)
    assert chunks == [(0, 0, 2 * HB)] and is_whole_block(chunks, src, dst)
    assert block_chunks(rank(2, 0, 4), rank(2, 1, 4)) == []  # other heads: nothing


def test_split_and_merge_of_head_ranges():
    # TP 1 -> 2: the single rank writes heads 2..3 (bytes 2..4 KiB) into rank 1's block
    assert block_chunks(rank(1, 0, 4), rank(2, 1, 4)) == [(2 * HB, 0, 2 * HB)]
    # TP 2 -> 1: rank 1's whole block lands in the second half of the dst block
    chunks = block_chunks(rank(2, 1, 4), rank(1, 0, 4))
    assert chunks == [(0, 2 * HB, 2 * HB)]
    assert not is_whole_block(chunks, rank(2, 1, 4), rank(1, 0, 4))
    # TP 4 -> 2: head 3 is the second head of dst rank 1
    assert block_chunks(rank(4, 3, 4), rank(2, 1, 4)) == [(0, HB, HB)]
    assert heads_to_write(rank(1, 0, 8), rank(4, 2, 8)) == [4, 5]


def test_replicated_heads_are_written_by_the_lowest_source_rank_only():
    # P TP 4 over 2 heads: ranks 0,1 hold head 0, ranks 2,3 head 1
    assert [writer_rank(h, 2, 4) for h in range(2)] == [0, 2]
    dst = rank(1, 0, 2)
    assert [block_chunks(rank(4, r, 2), dst) for r in range(4)] == [
        [(0, 0, HB)],
        [],
        [(0, HB, HB)],
        [],
    ]
    # D TP 4 over 2 heads: the single source rank writes each replica
    src = rank(1, 0, 2)
    assert [block_chunks(src, rank(4, r, 2)) for r in range(4)] == [
        [(0, 0, HB)],
        [(0, 0, HB)],
        [(HB, 0, HB)],
        [(HB, 0, HB)],
    ]
    assert [writer_rank(h, 8, 2) for h in (0, 3, 4, 7)] == [0, 0, 1, 1]


@pytest.mark.parametrize("total", [1, 2, 4, 8])
def test_every_destination_byte_is_written_once_with_the_right_head(total):
    tps = [t for t in (1, 2, 4, 8) if (t <= total and total % t == 0) or t % total == 0]
    for p_tp, d_tp in itertools.product(tps, tps):
        check_tp_pair(p_tp, d_tp, total)
        for d in range(d_tp):
            dst = rank(d_tp, d, total)
            owner = [None] * (dst.block_bytes // HB)  # dst head slot -> (src rank, head)
            for p in range(p_tp):
                src = rank(p_tp, p, total)
                for so, do, n in block_chunks(src, dst):
                    assert so % HB == do % HB == n % HB == 0
                    for k in range(n // HB):
                        slot = do // HB + k
                        assert owner[slot] is None, (p_tp, d_tp, d, slot)
                        owner[slot] = (p, src.kv_heads[so // HB + k])
            assert [o[1] for o in owner] == list(dst.kv_heads), (p_tp, d_tp, d)


@pytest.mark.parametrize(
    "p_tp,d_tp,total,side",
    [(3, 1, 4, "source tp_size 3"), (2, 3, 4, "destination tp_size 3"), (4, 1, 3, "source")],
)
def test_impossible_tp_pairs_are_named(p_tp, d_tp, total, side):
    with pytest.raises(KVLayoutMismatch, match=side) as err:
        check_tp_pair(p_tp, d_tp, total)
    assert set(err.value.fields) == {"tp_size", "total_kv_heads"}
    assert f"total_kv_heads {total}" in str(err.value)


def test_chunks_refuse_incompatible_ranks():
    with pytest.raises(KVLayoutMismatch, match="total_kv_heads"):
        block_chunks(rank(2, 0, 4), rank(2, 0, 8))
    with pytest.raises(ValueError, match="head 4 out of range"):
        writer_rank(4, 4, 2)


def test_chunk_regions_coalesce_whole_blocks_and_split_partial_ones():
    runs = [(0, 5, 3), (9, 1, 1)]
    # whole blocks: one region per run, split above max_region_bytes
    assert chunk_regions(runs, [(0, 0, 100)], 1000, 0, 100, 100, 250) == [
        (1000, 500, 250),
        (1250, 750, 50),
        (1900, 100, 100),
    ]
    # partial: one region per block per chunk, at each side's own block size
    regions = chunk_regions(runs, [(0, 100, 100)], 1000, 0, 100, 200, 1 << 20)
    assert regions == [(1000, 1100, 100), (1100, 1300, 100), (1200, 1500, 100), (1900, 300, 100)]
    # a long chunk is split too
    assert chunk_regions([(0, 0, 1)], [(50, 0, 100)], 0, 0, 200, 100, 60) == [
        (50, 0, 60),
        (110, 60, 40),
    ]
