"""Choosing a (decode, prefill) pair for one attempt of one request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.policies import Policy


@dataclass
class Avoid:
    """What earlier attempts of the same request ran into."""

    pairs: set[tuple[str, str]] = field(default_factory=set)
    decode: set[str] = field(default_factory=set)
    prefill: set[str] = field(default_factory=set)

    def add(self, decode: str, prefill: str) -> None:
        self.pairs.add((decode, prefill))
        self.decode.add(decode)
        self.prefill.add(prefill)


def choose_pair(
    pairs: Sequence[tuple[Any, Any]],
    key: str,
    decode_policy: Policy,
    prefill_policy: Policy,
    avoid: Avoid | None = None,
) -> tuple[Any, Any] | None:
    """Pick a decode worker by its policy, then one of its prefill peers by theirs.

    Pairs that already failed this request are never retried; among the rest, pairs
    avoiding both failed workers are preferred, then pairs avoiding the failed decode
    worker (its prefill peer may have been the culprit, or not)."""
    avoid = avoid or Avoid()
    left = [(d, p) for d, p in pairs if (d.address, p.address) not in avoid.pairs]
    tiers = (
        [
            (d, p)
            for d, p in left
            if d.address not in avoid.decode and p.address not in avoid.prefill
        ],
        [(d, p) for d, p in left if d.address not in avoid.decode],
        left,
    )
    candidates = next((t for t in tiers if t), None)
    if not candidates:
        return None
    decodes = list({id(d): d for d, _ in candidates}.values())
    decode = decode_policy.choose(decodes, key)
    prefills = [p for d, p in candidates if d is decode]
    return decode, prefill_policy.choose(prefills, key)
