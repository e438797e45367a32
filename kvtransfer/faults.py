"""Faults injected on purpose, for tests of the KV path (off unless a test sets them).

A worker builds its connector with `TransferFaults.from_env()` and its prefill service
reads `PrefillStalls.from_env()`, each once at start; production leaves every variable
unset, so every field is zero and nothing changes. A fault is a deliberate test double
and never silent: every time one fires it is logged at WARNING (logger
`kvtransfer.faults`, the line starts with "fault injection:") and counted (`fired`,
also in the log line).

| variable | fault |
|---|---|
| PDSERVE_FAULT_WRITE_DELAY_S | every backend write call sleeps this long first |
| PDSERVE_FAULT_FAIL_EVERY_NTH_WRITE | every Nth KV write (transfer) fails, nothing sent |
| PDSERVE_FAULT_FAIL_HANDSHAKES | the first N peer handshakes (add_peer) fail |
| PDSERVE_FAULT_STALL_BEFORE_PREFILL_S | each Prefill waits this long before computing |
| PDSERVE_FAULT_STALL_AFTER_PREFILL_S | ... and this long between computing and writing |
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WRITE_DELAY_ENV = "PDSERVE_FAULT_WRITE_DELAY_S"
FAIL_EVERY_NTH_WRITE_ENV = "PDSERVE_FAULT_FAIL_EVERY_NTH_WRITE"
FAIL_HANDSHAKES_ENV = "PDSERVE_FAULT_FAIL_HANDSHAKES"
STALL_BEFORE_PREFILL_ENV = "PDSERVE_FAULT_STALL_BEFORE_PREFILL_S"
STALL_AFTER_PREFILL_ENV = "PDSERVE_FAULT_STALL_AFTER_PREFILL_S"


class _Tally:
    """Thread-safe counts of what was seen and what fired. Picklable (the transfer
    faults travel to tensor-parallel rank processes): a copy starts from zero."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seen: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()

    def see(self, kind: str) -> int:
        with self._lock:
            self.seen[kind] += 1
            return self.seen[kind]

    def fire(self, kind: str) -> int:
        with self._lock:
            self.fired[kind] += 1
            return self.fired[kind]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fired)

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


def _env_number(name: str, kind: type, what: str):
    raw = os.environ.get(name, "0")
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    return value


@dataclass(frozen=True)
class TransferFaults:
    # Every backend write call sleeps this long before it starts, on the thread that
    # makes it: a slow link whose write cannot be called back once it is under way.
    write_delay_s: float = 0.0
    # Every Nth write (one write_blocks call that has something to send, counted per
    # connector) fails before sending anything, as a refused transfer; 0: never.
    fail_every_nth_write: int = 0
    # The first N peer handshakes (add_peer: a prefill worker's Handshake answer, a
    # decode worker's check of it, a writer meeting a new peer) fail; 0: none.
    fail_handshakes: int = 0
    _tally: _Tally = field(default_factory=_Tally, compare=False, repr=False)

    def __post_init__(self):
        if not self.write_delay_s >= 0:
            raise ValueError(f"write_delay_s must be >= 0, got {self.write_delay_s}")
        for name in ("fail_every_nth_write", "fail_handshakes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @classmethod
    def from_env(cls) -> TransferFaults:
        return cls(
            write_delay_s=_env_number(WRITE_DELAY_ENV, float, "a number of seconds"),
            fail_every_nth_write=_env_number(FAIL_EVERY_NTH_WRITE_ENV, int, "an integer >= 0"),
            fail_handshakes=_env_number(FAIL_HANDSHAKES_ENV, int, "an integer >= 0"),
        )

    @property
    def active(self) -> bool:
        return bool(self.write_delay_s > 0 or self.fail_every_nth_write or self.fail_handshakes)

    @property
    def fired(self) -> dict[str, int]:
        """How many times each fault fired: write_delay, fail_write, fail_handshake."""
        return self._tally.snapshot()

    # --- hooks (called by the connectors) ------------------------------------------
    def delay_write(self) -> float:
        """Sleep write_delay_s (on the calling thread); returns the delay slept."""
        if not self.write_delay_s:
            return 0.0
        n = self._tally.fire("write_delay")
        log.warning("fault injection: delaying a write by %gs (#%d)", self.write_delay_s, n)
        time.sleep(self.write_delay_s)
        return self.write_delay_s

    def fail_write(self, peer: str) -> bool:
        """True when this write must fail (every fail_every_nth_write-th one)."""
        if not self.fail_every_nth_write:
            return False
        seen = self._tally.see("write")
        if seen % self.fail_every_nth_write:
            return False
        n = self._tally.fire("fail_write")
        log.warning(
            "fault injection: failing KV write %d to %s (every %d%s; #%d)",
            seen,
            peer,
            self.fail_every_nth_write,
            _ordinal(self.fail_every_nth_write),
            n,
        )
        return True

    def fail_handshake(self, peer: str) -> bool:
        """True for each of the first fail_handshakes handshakes."""
        if not self.fail_handshakes:
            return False
        seen = self._tally.see("handshake")
        if seen > self.fail_handshakes:
            return False
        n = self._tally.fire("fail_handshake")
        log.warning(
            "fault injection: failing handshake %d with %s (the first %d fail; #%d)",
            seen,
            peer,
            self.fail_handshakes,
            n,
        )
        return True


@dataclass(frozen=True)
class PrefillStalls:
    """Per-request stalls of a prefill worker (asyncio sleeps: other requests go on, a
    cancellation ends the stall): before the prompt is computed (the decode worker's
    blocks are reserved, the prefill worker holds nothing yet) and between computing
    and writing (both sides hold the request's blocks)."""

    before_s: float = 0.0
    after_s: float = 0.0
    _tally: _Tally = field(default_factory=_Tally, compare=False, repr=False)

    def __post_init__(self):
        for name in ("before_s", "after_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls) -> PrefillStalls:
        return cls(
            before_s=_env_number(STALL_BEFORE_PREFILL_ENV, float, "a number of seconds"),
            after_s=_env_number(STALL_AFTER_PREFILL_ENV, float, "a number of seconds"),
        )

    @property
    def active(self) -> bool:
        return self.before_s > 0 or self.after_s > 0

    @property
    def fired(self) -> dict[str, int]:
        """How many stalls started: stall_before_prefill, stall_after_prefill."""
        return self._tally.snapshot()

    def stall(self, when: str, request_id: str) -> float:
        """The stall to sleep now ("before" or "after" the prefill), logged and counted
        when not zero; the caller sleeps it (asyncio)."""
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', got {when!r}")
        seconds = self.before_s if when == "before" else self.after_s
        if seconds:
            n = self._tally.fire(f"stall_{when}_prefill")
            log.warning(
                "fault injection: stalling request %s %.2fs %s prefill (#%d)",
                request_id,
                seconds,
                when,
                n,
            )
        return seconds


def _ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
