"""pdpb/heap.py: the startup heap frozen out of the collector, and its pauses recorded
from gc.callbacks and handed to a metrics callback by the reporting task."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pdpb.heap import GCPauses, freeze_startup_heap, report_gc_pauses


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session collects as before


@pytest.fixture
def explicit_only():
    """Only this test's gc.collect() calls collect: another thread of the test session
    allocating must not add a collection of its own in between."""
    gc.disable()
    yield
    gc.enable()


def test_freeze_moves_live_objects_out_of_the_collector(unfrozen):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(1000)]  # alive at the freeze
    assert any(o is keep[0] for o in gc.get_objects())  # walked by collections
    frozen = freeze_startup_heap()
    # (frozen objects that die later leave the count: it is a count at that moment)
    assert frozen >= len(keep)
    # the collector's generations no longer hold them; what comes later they do
    tracked = gc.get_objects()
    assert not any(o is keep[0] or o is keep for o in tracked)
    later = [0]
    assert any(o is later for o in gc.get_objects())


def test_pauses_are_recorded_by_generation_and_drained_once(explicit_only):
    pauses = GCPauses()
    pauses.install()
    pauses.install()  # twice is once
    try:
        assert gc.callbacks.count(pauses._on_gc) == 1
        gc.collect(1)
        gc.collect(0)
        drained = pauses.drain()
        assert [g for g, _ in drained] == [1, 0]
        assert all(s >= 0 for _, s in drained)
        assert pauses.drain() == []
    finally:
        pauses.uninstall()
    assert pauses._on_gc not in gc.callbacks
    gc.collect(0)
    assert pauses.drain() == []  # uninstalled: nothing more is recorded


def test_the_report_task_observes_each_pause_and_uninstalls_when_cancelled(explicit_only):
    seen: list[tuple[int, float]] = []
    pauses = GCPauses()

    async def run():
        task = asyncio.ensure_future(
            report_gc_pauses(pauses, lambda g, s: seen.append((g, s)), 0.01)
        )
        await asyncio.sleep(0.02)
        gc.collect(2)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert 2 in [g for g, _ in seen]
    assert pauses._on_gc not in gc.callbacks
