"""Start-up phases of an engine / worker: each one's duration logged at INFO when it
ends, and a progress line every `progress_every_s` while a long one runs, so a start
that takes minutes (kernel tuning, compilation) can be watched."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger(__name__)


class StartupPhases:
    def __init__(self, progress_every_s: float = 15.0):
        if progress_every_s <= 0:
            raise ValueError(f"progress_every_s must be positive, got {progress_every_s}")
        self.progress_every_s = progress_every_s
        self.durations: dict[str, float] = {}  # phase name -> seconds, in order
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        done = threading.Event()

        def progress():
            while not done.wait(self.progress_every_s):
                log.info("start-up: %s still running (%.0fs so far)", name, _since(started))

        threading.Thread(target=progress, name=f"startup-{name}", daemon=True).start()
        try:
            yield
        finally:
            done.set()
            self.durations[name] = _since(started)
        log.info("start-up: %s took %.2fs", name, self.durations[name])

    @property
    def total_s(self) -> float:
        return _since(self._started)

    def summary(self) -> str:
        """One line: every phase and the total, e.g. 'weights 2.1s, warmup 0.4s; total 3.0s'."""
        parts = ", ".join(f"{name} {s:.1f}s" for name, s in self.durations.items())
        return f"{parts}; total {self.total_s:.1f}s"


def _since(t: float) -> float:
    return time.perf_counter() - t
