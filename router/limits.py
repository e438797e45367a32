"""Admission control: at most `limit` generation requests in flight, and at most
`per_key` for one API key (one client cannot hold every slot); the rest get 429."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from collections import Counter


def key_digest(value: str) -> bytes:
    # equal-length digests: compare_digest's time then says nothing about key lengths
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def _check_limits(limit: int, per_key: int) -> None:
    if limit < 0:
        raise ValueError("limit must be >= 0 (0: no limit)")
    if per_key < 0:
        raise ValueError("per_key must be >= 0 (0: no limit)")


class ConcurrencyLimit:
    def __init__(self, limit: int, per_key: int = 0):
        _check_limits(limit, per_key)
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


class SharedConcurrencyLimit:
    """ConcurrencyLimit across API-server processes (--api-server-count > 1): the counts
    live in a file every process maps, updated under an flock, so the limits hold for
    the router as a whole however connections fall on its processes.

    Layout: int64 [in flight, then one count per configured API key]; a key is found by
    its digest (the keys are known at start: a request with another key never gets here)."""

    _SLOT = struct.Struct("q")

    def __init__(self, path: str, limit: int, per_key: int, key_digests: list[bytes]):
        _check_limits(limit, per_key)
        self.limit = limit
        self.per_key = per_key
        self._slots = {digest: i + 1 for i, digest in enumerate(key_digests)}
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.file_size(len(key_digests)))

    @classmethod
    def file_size(cls, num_keys: int) -> int:
        return cls._SLOT.size * (1 + num_keys)

    @classmethod
    def create(cls, path: str, num_keys: int) -> None:
        """The zeroed counts file, made by the supervisor before any process maps it."""
        with open(path, "wb") as f:
            f.write(bytes(cls.file_size(num_keys)))

    def _get(self, slot: int) -> int:
        return self._SLOT.unpack_from(self._map, slot * self._SLOT.size)[0]

    def _add(self, slot: int, delta: int) -> None:
        self._SLOT.pack_into(self._map, slot * self._SLOT.size, self._get(slot) + delta)

    @property
    def inflight(self) -> int:
        return self._get(0)

    def key_full(self, key: bytes | None) -> bool:
        slot = self._slots.get(key) if key is not None else None
        return bool(self.per_key and slot is not None and self._get(slot) >= self.per_key)

    def try_acquire(self, key: bytes | None = None) -> bool:
        slot = self._slots.get(key) if key is not None else None
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if (self.limit and self._get(0) >= self.limit) or self.key_full(key):
                return False
            self._add(0, 1)
            if slot is not None:
                self._add(slot, 1)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self, key: bytes | None = None) -> None:
        slot = self._slots.get(key) if key is not None else None
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self._add(0, -1)
            if slot is not None:
                self._add(slot, -1)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
