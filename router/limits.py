"""Admission control: at most `limit` generation requests in flight, and at most
`per_key` for one API key (one client cannot hold every slot); the rest get 429."""

from __future__ import annotations

from collections import Counter


class ConcurrencyLimit:
    def __init__(self, limit: int, per_key: int = 0):
        if limit < 0:
            raise ValueError("limit must be >= 0 (0: no limit)")
        if per_key < 0:
            raise ValueError("per_key must be >= 0 (0: no limit)")
        self.limit = limit
        self.per_key = per_key
        self.inflight = 0
        self.by_key: Counter[bytes] = Counter()  # keyed by the key's digest, never the key

    def key_full(self, key: bytes | None) -> bool:
        return bool(self.per_key and key is not None and self.by_key[key] >= self.per_key)

    def try_acquire(self, key: bytes | None = None) -> bool:
        if (self.limit and self.inflight >= self.limit) or self.key_full(key):
            return False
        self.inflight += 1
        if key is not None:
            self.by_key[key] += 1
        return True

    def release(self, key: bytes | None = None) -> None:
        self.inflight -= 1
        if key is not None:
            self.by_key[key] -= 1
            if not self.by_key[key]:
                del self.by_key[key]
