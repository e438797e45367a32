"""The KV connector interface: what a worker needs to push KV blocks into a peer.

One connector per worker process. At start-up the worker registers its whole KV buffer
once (``register``) and publishes ``agent_info()`` through the control plane. A writer
(prefill) calls ``add_peer`` with the reader's (decode) info as soon as it learns it, so
layout mismatches surface at registration time, then ``write_blocks`` per request.

Backends implement ``register``, ``agent_info``, ``close`` and ``_write_regions``;
validation, coalescing, counters and error wrapping live here so every backend behaves
the same way.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtransfer.faults import TransferFaults
from kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible, coalesce
from kvtransfer.tp_plan import block_chunks, chunk_regions


class KVTransferError(RuntimeError):
    """A transfer failed or did not finish within its timeout.

    ``peer`` is the peer's session id, ``code`` the backend return code (None when the
    failure was not a backend call, e.g. a timeout), ``timed_out`` tells timeouts apart.
    ``in_flight``, when not None, is set once a backend call that the caller walked away
    from has returned: until then it may still write into the peer's blocks.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        code: int | None = None,
        timed_out: bool = False,
        in_flight: threading.Event | None = None,
    ):
        context = [f"peer={peer}"] if peer is not None else []
        if code is not None:
            context.append(f"rc={code}")
        super().__init__(f"{message} ({', '.join(context)})" if context else message)
        self.peer = peer
        self.code = code
        self.timed_out = timed_out
        self.in_flight = in_flight


def _split_session_id(session_id: str) -> tuple[str, int]:
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"session_id must look like 'host:port', got {session_id!r}")
    return host, int(port)


@dataclass(frozen=True)
class KVAgentInfo:
    """Everything a peer needs to write into our KV buffer.

    JSON-safe through to_dict/from_dict (or to_json/from_json) so the gRPC layer can carry
    it either as fields or as one string. base_addr is a 64-bit virtual address: keep it
    a uint64/int, never a float.
    """

    session_id: str
    base_addr: int
    layout: KVLayout
    backend: str = "mooncake"
    protocol: str = "tcp"

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str):
            raise ValueError(f"session_id must be a str, got {type(self.session_id).__name__}")
        _split_session_id(self.session_id)
        if isinstance(self.base_addr, bool) or not isinstance(self.base_addr, int):
            raise ValueError(f"base_addr must be an int, got {self.base_addr!r}")
        if not 0 < self.base_addr < 2**64:
            raise ValueError(f"base_addr must be a non-null 64-bit address, got {self.base_addr}")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        for name in ("backend", "protocol"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")

    @property
    def host(self) -> str:
        return _split_session_id(self.session_id)[0]

    @property
    def port(self) -> int:
        return _split_session_id(self.session_id)[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "base_addr": self.base_addr,
            "layout": self.layout.to_dict(),
            "backend": self.backend,
            "protocol": self.protocol,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVAgentInfo:
        try:
            layout = data["layout"]
            return cls(
                session_id=data["session_id"],
                base_addr=int(data["base_addr"]),
                layout=layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout),
                backend=data.get("backend", "mooncake"),
                protocol=data.get("protocol", "tcp"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad KVAgentInfo dict {data!r}: {exc!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVAgentInfo:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class TransferStats:
    """What one write_blocks call moved and how long it took."""

    bytes: int
    num_blocks: int
    num_regions: int
    num_batches: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes), 0 for an empty transfer."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


_COUNTERS = (
    "transfers_ok",
    "transfers_failed",
    "transfers_timed_out",
    "bytes",
    "blocks",
    "regions",
    "batches",
    "seconds",
)


class KVConnector(ABC):
    """Moves whole KV blocks from our registered buffer into a peer's."""

    backend: ClassVar[str] = "abstract"

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _peers and _counters
        self._peers: dict[str, KVAgentInfo] = {}
        self._counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._counters["seconds"] = 0.0
        self.faults = TransferFaults()  # injected on purpose by tests (kvtransfer/faults.py)

    # --- backend hooks -------------------------------------------------------------
    @abstractmethod
    def register(self, base_addr: int, nbytes: int, layout: KVLayout) -> None:
        """Register the whole KV buffer (once, at start-up).

        base_addr/nbytes describe memory the caller owns and must keep alive (and at the
        same address) until close(); nbytes must cover layout.num_blocks blocks.
        """

    @abstractmethod
    def agent_info(self) -> KVAgentInfo:
        """What peers need to write into us; valid after register()."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend (unregister memory, stop listeners). Idempotent."""

    @abstractmethod
    def _write_regions(
        self, peer: KVAgentInfo, regions: list[tuple[int, int, int]], deadline: float
    ) -> int:
        """Write (src_addr, dst_addr, length) regions to peer before the monotonic
        deadline; return the number of backend batches. Raise KVTransferError on any
        failure or when the deadline passes, never block past it."""

    @abstractmethod
    def _max_region_bytes(self) -> int:
        """Largest single region the backend should be handed."""

    # --- shared behaviour ----------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self.agent_info().layout

    def add_peer(self, info: KVAgentInfo) -> None:
        """Check the peer is compatible and remember it.

        The peer may run another TP degree (its rank holds other heads of the same
        model). Raises KVLayoutMismatch naming every disagreeing field (layout fields,
        and backend/protocol), so a bad pairing fails before any request is routed to it.
        """
        local = self.agent_info()
        if self.faults.fail_handshake(info.session_id):
            raise KVTransferError("fault injection: handshake failed", peer=info.session_id)
        diffs: list[str] = []
        details: list[str] = []
        for name in ("backend", "protocol"):
            mine, theirs = getattr(local, name), getattr(info, name)
            if mine != theirs:
                diffs.append(name)
                details.append(f"{name}: local={mine!r} remote={theirs!r}")
        try:
            check_compatible(local.layout, info.layout)
        except KVLayoutMismatch as exc:
            diffs.extend(exc.fields)
            details.append(str(exc))
        if diffs:
            raise KVLayoutMismatch(
                f"peer {info.session_id} is incompatible: {'; '.join(details)}", diffs
            )
        with self._lock:
            self._peers[info.session_id] = info

    def peers(self) -> list[KVAgentInfo]:
        with self._lock:
            return list(self._peers.values())

    def write_blocks(
        self,
        peer: KVAgentInfo,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        """Copy our blocks src_block_ids[i] into the peer's dst_block_ids[i].

        When both ranks hold the same KV heads, whole blocks move and consecutive runs
        are coalesced into single regions. Otherwise only the heads this rank owns among
        the peer's (kvtransfer/tp_plan.py) are written into each destination block, one
        region per block per contiguous head range; when it owns none, nothing is sent
        and the stats are zero. Returns once every byte has landed; raises
        KVTransferError on failure or after timeout_s (on a timeout the destination
        blocks hold undefined data). Bad arguments raise ValueError and an incompatible
        peer KVLayoutMismatch, before anything is sent.
        """
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"timeout_s must be a number, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        start = time.monotonic()
        deadline = start + timeout_s
        local = self.agent_info()
        with self._lock:
            known = self._peers.get(peer.session_id)
        if known != peer:  # new or changed (e.g. the peer restarted): check it first
            self.add_peer(peer)

        runs = coalesce(src_block_ids, dst_block_ids)
        for s, d, n in runs:
            if s + n > local.layout.num_blocks:
                raise ValueError(
                    f"src block {s + n - 1} out of range (local has "
                    f"{local.layout.num_blocks} blocks)"
                )
            if d + n > peer.layout.num_blocks:
                raise ValueError(
                    f"dst block {d + n - 1} out of range (peer {peer.session_id} has "
                    f"{peer.layout.num_blocks} blocks)"
                )
        chunks = block_chunks(local.layout, peer.layout)
        if not runs or not chunks:  # nothing asked, or another rank owns these heads
            return TransferStats(0, 0, 0, 0, 0.0)
        num_blocks = sum(n for _, _, n in runs)
        regions = chunk_regions(
            runs,
            chunks,
            local.base_addr,
            peer.base_addr,
            local.layout.block_bytes,
            peer.layout.block_bytes,
            self._max_region_bytes(),
        )
        try:
            if self.faults.fail_write(peer.session_id):
                raise KVTransferError("fault injection: KV write failed", peer=peer.session_id)
            num_batches = self._write_regions(peer, regions, deadline)
        except KVTransferError as exc:
            self._count(failed=True, timed_out=exc.timed_out)
            raise
        except Exception as exc:  # a backend bug must still count and carry the peer
            self._count(failed=True)
            raise KVTransferError(f"transfer failed: {exc!r}", peer=peer.session_id) from exc
        stats = TransferStats(
            bytes=num_blocks * sum(c[2] for c in chunks),
            num_blocks=num_blocks,
            num_regions=len(regions),
            num_batches=num_batches,
            seconds=time.monotonic() - start,
        )
        self._count(stats=stats)
        return stats

    def _count(
        self,
        stats: TransferStats | None = None,
        failed: bool = False,
        timed_out: bool = False,
    ) -> None:
        with self._lock:
            c = self._counters
            if failed:
                c["transfers_failed"] += 1
                c["transfers_timed_out"] += int(timed_out)
            if stats is not None:
                c["transfers_ok"] += 1
                c["bytes"] += stats.bytes
                c["blocks"] += stats.num_blocks
                c["regions"] += stats.num_regions
                c["batches"] += stats.num_batches
                c["seconds"] += stats.seconds

    def stats(self) -> dict[str, float]:
        """Cumulative counters for metrics (transfers_ok/failed/timed_out, bytes, ...)."""
        with self._lock:
            return dict(self._counters)

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
