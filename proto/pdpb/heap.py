"""The Python heap of a serving process: its startup objects frozen out of the cyclic
garbage collector, and the collector's pauses made visible.

Every serving process (router API server, prefill and decode worker) holds a large
heap it builds at startup and keeps for life (torch and transformers modules, the
tokenizer, the KV block pool, aiohttp's app), and its hot loop allocates short-lived,
acyclic objects at a high rate. Each time enough of those survive a young collection,
CPython's oldest-generation collection walks the whole heap, stopping every thread of
the process (the GIL) to reclaim almost nothing: at 512 streams on a decode worker that
cost a third of its throughput (docs/performance.md). `freeze_startup_heap` moves what
exists after start-up into the permanent generation (`gc.freeze`, as vLLM's engine
core and API server and SGLang do), so later collections only walk what requests
allocate. Cycles made later are still collected.

It lives in pdpb because that is the one first-party package both the router and the
workers may import (see tls.py)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

# seconds; a young collection takes microseconds, a full one of an unfrozen worker's
# heap tens to hundreds of milliseconds
PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object still alive out of
    future collections. Returns how many objects are frozen (call once start-up is
    done, before the first request)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Records each collection's pause from gc.callbacks, without locks: the callback
    runs inside whatever allocation triggered the collection, possibly while that
    thread holds a metrics lock, so it only appends to a list (atomic under the GIL).
    `drain()` hands the pauses recorded since the last call to the caller, who puts
    them in its metrics from its own loop."""

    def __init__(self):
        self._started: float | None = None
        self._pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def drain(self) -> list[tuple[int, float]]:
        pauses, self._pauses = self._pauses, []
        return pauses

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pauses.append((info["generation"], time.perf_counter() - self._started))
            self._started = None


async def report_gc_pauses(
    pauses: GCPauses, observe: Callable[[int, float], None], interval_s: float = 1.0
) -> None:
    """Forever (a task): every interval_s, observe(generation, seconds) for each pause
    recorded since the last round."""
    import asyncio

    pauses.install()
    try:
        while True:
            await asyncio.sleep(interval_s)
            for generation, seconds in pauses.drain():
                observe(generation, seconds)
    finally:
        pauses.uninstall()
