"""Faults injected on purpose, for tests of the KV path (off unless a test sets them).

A worker builds its connector with `TransferFaults.from_env()`; production leaves every
variable unset, so every field is zero and nothing changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

WRITE_DELAY_ENV = "PDSERVE_FAULT_WRITE_DELAY_S"


@dataclass(frozen=True)
class TransferFaults:
    # Every backend write call sleeps this long before it starts, on the thread that
    # makes it: a slow link whose write cannot be called back once it is under way.
    write_delay_s: float = 0.0

    def __post_init__(self):
        if not self.write_delay_s >= 0:
            raise ValueError(f"write_delay_s must be >= 0, got {self.write_delay_s}")

    @classmethod
    def from_env(cls) -> TransferFaults:
        raw = os.environ.get(WRITE_DELAY_ENV, "0")
        try:
            delay = float(raw)
        except ValueError:
            raise ValueError(
                f"{WRITE_DELAY_ENV} must be a number of seconds, got {raw!r}"
            ) from None
        return cls(write_delay_s=delay)

    @property
    def active(self) -> bool:
        return self.write_delay_s > 0
