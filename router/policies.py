"""Worker choice policies, one class each: `choose(workers, key) -> worker`.

`workers` is a non-empty sequence of healthy candidates (anything with `address`,
`inflight` and `load`, a LoadReport or None); `key` is the request's prefix key (see
protocol.Prompt.prefix_key). Each pool (prefill, decode) gets its own policy instance,
so state such as a round-robin counter is per pool. Adding a policy: write a class with
`choose` and list it in POLICIES."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any, Protocol


class Policy(Protocol):
    name: str

    def choose(self, workers: Sequence[Any], key: str) -> Any: ...


def load_score(worker: Any) -> tuple[int, float]:
    """(requests on the worker, KV usage): lower is less loaded.

    The router's own in-flight count is exact and immediate; the worker's last
    LoadReport (running + waiting) also sees other routers' requests. Take the larger."""
    report = worker.load
    busy = worker.inflight
    usage = 0.0
    if report is not None:
        busy = max(busy, report.num_running + report.num_waiting)
        if report.num_total_blocks:
            usage = 1.0 - report.num_free_blocks / report.num_total_blocks
    return busy, usage


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def choose(self, workers: Sequence[Any], key: str) -> Any:
        return workers[next(self._counter) % len(workers)]


class LeastLoad:
    """The least-loaded worker; ties go round-robin so an idle pool is used evenly."""

    name = "least_load"

    def __init__(self):
        self._counter = itertools.count()

    def choose(self, workers: Sequence[Any], key: str) -> Any:
        scores = [load_score(w) for w in workers]
        best = min(scores)
        tied = [w for w, s in zip(workers, scores) if s == best]
        return tied[next(self._counter) % len(tied)]


class PrefixAware:
    """Requests with the same prefix key go to the same worker (its prefix cache hits).

    Rendezvous hashing: the worker with the highest hash(key, address) wins, so adding
    or removing a worker only moves the keys that belonged to it. When the chosen worker
    has `balance_threshold` more requests in flight than the least loaded one, the
    least-loaded wins instead (a hot prefix must not pin one worker)."""

    name = "prefix_aware"

    def __init__(self, balance_threshold: int = 32):
        self.balance_threshold = balance_threshold
        self._fallback = LeastLoad()

    @staticmethod
    def _rank(key: str, address: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()

    def choose(self, workers: Sequence[Any], key: str) -> Any:
        chosen = max(workers, key=lambda w: self._rank(key, w.address))
        least = min(load_score(w)[0] for w in workers)
        if load_score(chosen)[0] - least > self.balance_threshold:
            return self._fallback.choose(workers, key)
        return chosen


POLICIES: dict[str, type] = {p.name: p for p in (RoundRobin, LeastLoad, PrefixAware)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
