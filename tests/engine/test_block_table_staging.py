"""The graph runners' block-table staging writes only what changed since the last step,
and the host buffer always holds every row's table: checked against a full write over
random steps in which sequences grow, leave, arrive, swap rows, get freed and
re-allocated (a new list), and another writer overwrites a row. The block manager's
side of the contract: a block table only grows, and freeing gives the sequence a new
list, leaving the old one as it was."""

from __future__ import annotations

import random

import numpy as np

from services.engine.block_manager import BlockManager
from services.engine.block_table_staging import BlockTableStager
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence


def _assert_holds(host: np.ndarray, tables: list[list[int]]) -> None:
    for i, table in enumerate(tables):
        assert host[i, : len(table)].tolist() == table, f"row {i}"


def test_staging_equals_a_full_write_through_random_steps():
    rng = random.Random(0)
    rows, width = 24, 16
    stager = BlockTableStager(np.full((rows, width), -1, dtype=np.int32))
    next_block = iter(range(10**6))
    live = [[next(next_block)] for _ in range(rows)]
    for _ in range(400):
        batch = rng.sample(live, rng.randint(1, rows))
        stager.stage(batch)
        _assert_holds(stager.host, batch)
        for table in live:  # some grow, in place, as the block manager appends
            if len(table) < width and rng.random() < 0.2:
                table.append(next(next_block))
        if rng.random() < 0.3:  # one leaves; a new sequence (a new list) takes its place
            live[rng.randrange(rows)] = [next(next_block) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.1:  # another writer (the padding sequence) takes a row
            row = rng.randrange(rows)
            stager.host[row, :3] = 0
            stager.overwritten(row)


def test_an_unchanged_row_is_not_written_and_a_grown_one_only_at_its_end():
    stager = BlockTableStager(np.zeros((2, 8), dtype=np.int32))
    a, b = [5, 6], [7]
    stager.stage([a, b])
    stager.host[0, 0] = -9  # a stale mark: rewriting row 0 would erase it
    b.append(8)
    stager.stage([a, b])
    assert stager.host[0, :2].tolist() == [-9, 6]
    assert stager.host[1, :2].tolist() == [7, 8]
    stager.stage([b, a])  # rows swapped: both rewritten whole
    _assert_holds(stager.host, [b, a])


def test_freeing_a_sequence_leaves_its_old_table_as_it_was():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("s", list(range(10)), SamplingParams())
    assert bm.allocate(seq, 10)
    old = seq.block_table
    blocks = list(old)
    assert bm.allocate(seq, 13) and seq.block_table is old  # grows in place
    assert old[: len(blocks)] == blocks
    grown = list(old)
    bm.free(seq)
    assert seq.block_table == [] and seq.block_table is not old
    assert old == grown  # untouched: a stager holding it still compares correctly
