"""Admission control: at most `limit` generation requests in flight; the rest get 429."""

from __future__ import annotations


class ConcurrencyLimit:
    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError("limit must be >= 0 (0: no limit)")
        self.limit = limit
        self.inflight = 0

    def try_acquire(self) -> bool:
        if self.limit and self.inflight >= self.limit:
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        self.inflight -= 1
