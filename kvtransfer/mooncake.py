"""Mooncake Transfer Engine backend.

Facts this code relies on (mooncake-transfer-engine 0.3.13, measured on loopback TCP):
- Every engine call returns 0 / -1 (batch ids: 0 on failure) and never raises: each
  return code is checked here.
- "P2PHANDSHAKE" metadata needs no metadata server; the peer's session id is
  "host:<its get_rpc_port()>". Listeners bind all interfaces whatever hostname is given.
- Several engines can live in one process (the tests use two).
- More than ~2048 requests queued to one peer over TCP fail with "TCP lane queue-full
  rejection" and the engine->peer pair keeps failing for a while, so requests go out in
  batches of at most max_batch, one batch in flight per peer (per-peer lock). Override
  the limit with MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER.
- The blocking calls can outlive any sane request deadline: a stopped (SIGSTOPped) peer
  takes 30 s (MC_TCP_PROGRESS_TIMEOUT_SEC) to fail a write and 60 s (not configurable)
  to fail the handshake. So the engine calls run on a helper thread and the caller waits
  at most until its deadline. Each peer (session id) gets one long-lived daemon thread,
  "kv-write-<peer>", started on first use and fed by a queue: it runs that peer's writes
  one at a time, and exits at close(). Threads are not retired when a peer goes away, so
  a process holds one per distinct peer it ever wrote to. They are long-lived because
  nvlink_intra caches a CUDA stream + event per calling thread, and a thread's first call
  creates them and calls cudaGetDeviceProperties: a fresh thread per write cost ~1 ms a
  transfer (1.71 ms for 268 MB on H200, where the copy takes ~0.8 ms). An abandoned call
  keeps its peer's thread until the engine gives up; later writes to that peer wait
  behind it and time out at their own deadline, skipped unsent instead of piling up.
  A refused connection (peer gone) fails in about a millisecond.
- batch_transfer_sync_write releases the GIL and spins in C++ on the transfer status.
  With direct_writes (default for nvlink_intra), writes to a peer that has answered
  call it from the caller's thread, one at a time per peer, skipping the worker
  thread's two hand-offs (0.2-0.35 ms each on an H200 host, against ~1 ms for a 268 MB
  copy). Polling transfer_check_status from Python would take the GIL thousands of
  times a second from the engine thread that needs it.
- The first write to a peer handshakes while holding the engine's global mutex: a hung
  peer would stall writes to all peers. send_probe() takes no such lock, so a new peer
  is probed first (sub-millisecond when healthy).
- After a failed request the next one to the same peer can take ~1 s (the engine pauses
  the connection), and writes outside the peer's registered memory are rejected by it.
- Protocol "nvlink_intra" is only used when MC_INTRANODE_NVLINK is set before the engine
  is created; without it Mooncake silently falls back to TCP. We set it when missing.
  It needs a CUDA build of Mooncake (mooncake-transfer-engine-cuda13).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from kvtransfer.connector import KVAgentInfo, KVConnector, KVTransferError
from kvtransfer.faults import TransferFaults
from kvtransfer.layout import KVLayout, batched

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma", "nvlink_intra")
DEFAULT_METADATA = "P2PHANDSHAKE"
# Batches of 512 stay far below the ~2048 queued-request limit of a TCP peer; after
# coalescing a request rarely needs more than one batch anyway.
DEFAULT_MAX_BATCH = 512
# Region size made no measurable difference on loopback TCP (1.1-1.7 GB/s for pieces of
# 256 KiB to 256 MiB, and 4 MiB..1 GiB caps on a 360 MiB write, noise dominated); 64 MiB
# bounds each request (the engine's own timeout is 30 s + 1 s/GiB) at no cost.
DEFAULT_MAX_REGION_BYTES = 64 << 20
_TCP_QUEUE_LIMIT = 2048
_CLOSE_WAIT_S = 5.0


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # missing wheel, or libibverbs1 not installed
        raise ImportError(
            "Mooncake is not importable: pip install mooncake-transfer-engine-non-cuda "
            "(CPU) or mooncake-transfer-engine-cuda13 (GPU); it also needs libibverbs1. "
            f"Cause: {exc}"
        ) from exc
    return TransferEngine


def _serve(jobs: queue.SimpleQueue) -> None:
    """A peer's worker thread: run its jobs in order until the None sentinel.

    Holds only the queue between jobs, so an idle worker does not keep the connector
    (and its engine) alive."""
    while (job := jobs.get()) is not None:
        job()  # never raises: the job hands its outcome to the caller
        del job


class MooncakeConnector(KVConnector):
    """KVConnector over Mooncake's TransferEngine (tcp, rdma or nvlink_intra).

    The engine is created and initialised here; call register() with the KV buffer next.
    """

    backend = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        metadata: str = DEFAULT_METADATA,
        device_name: str = "",
        memory_location: str = "*",
        max_batch: int = DEFAULT_MAX_BATCH,
        max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
        direct_writes: bool | None = None,
        faults: TransferFaults | None = None,
    ):
        """hostname: address peers use to reach us (no port: the engine picks one).
        protocol: "tcp", "rdma" or "nvlink_intra". metadata: "P2PHANDSHAKE" (no server)
        or a metadata server URL such as "etcd://host:2379" / "http://host:8080/metadata".
        device_name: comma-separated RDMA NICs (e.g. "mlx5_0,mlx5_1"), "" for auto.
        memory_location: Mooncake location of the KV buffer ("*" = detect, "cpu:0",
        "cuda:0"). max_batch: requests per engine batch. max_region_bytes: larger
        regions are split. direct_writes: once a peer has answered, make its engine calls
        from the calling thread instead of the peer's worker thread; the caller's
        deadline is then checked between batches only, so None means only for
        nvlink_intra, where a copy into an open peer segment cannot hang and the
        hand-offs cost a third of the copy. faults: injected on purpose by tests
        (kvtransfer/faults.py); None injects nothing."""
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
        if not isinstance(hostname, str) or not hostname or hostname.count(":") == 1:
            # exactly one colon means "host:port"; IPv6 addresses have several
            raise ValueError(f"hostname must be a host without port, got {hostname!r}")
        if not metadata:
            raise ValueError("metadata must be 'P2PHANDSHAKE' or a metadata server URL")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        queue_limit = int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", _TCP_QUEUE_LIMIT))
        if protocol == "tcp" and max_batch >= queue_limit:
            raise ValueError(
                f"max_batch {max_batch} must stay below the TCP per-peer queue limit "
                f"({queue_limit}); larger batches are rejected and poison the peer"
            )
        if (
            isinstance(max_region_bytes, bool)
            or not isinstance(max_region_bytes, int)
            or max_region_bytes < 1
        ):
            raise ValueError(f"max_region_bytes must be a positive int, got {max_region_bytes!r}")
        if direct_writes is not None and not isinstance(direct_writes, bool):
            raise ValueError(f"direct_writes must be True, False or None, got {direct_writes!r}")
        if faults is not None and not isinstance(faults, TransferFaults):
            raise ValueError(f"faults must be a TransferFaults, got {type(faults).__name__}")

        if protocol == "nvlink_intra" and "MC_INTRANODE_NVLINK" not in os.environ:
            # Read when the engine installs its transports; without it Mooncake silently
            # uses TCP (~1.4 GB/s instead of ~345 GB/s on H200).
            os.environ["MC_INTRANODE_NVLINK"] = "1"

        self.hostname = hostname
        self.protocol = protocol
        self.metadata = metadata
        self.device_name = device_name
        self.memory_location = memory_location
        self.max_batch = max_batch
        self.max_region_bytes = max_region_bytes
        self.direct_writes = protocol == "nvlink_intra" if direct_writes is None else direct_writes
        self.faults = faults or TransferFaults()
        if self.faults.active:
            log.warning("KV transfer fault injection is on: %s", self.faults)

        engine_cls = _import_engine()
        self._engine: Any = engine_cls()
        rc = self._engine.initialize(hostname, metadata, protocol, device_name)
        if rc != 0:
            self._engine = None
            raise KVTransferError(
                f"Mooncake initialize({hostname!r}, {metadata!r}, {protocol!r}, "
                f"{device_name!r}) failed",
                code=rc,
            )
        port = self._engine.get_rpc_port()
        if not isinstance(port, int) or port <= 0:
            self._engine = None
            raise KVTransferError("Mooncake get_rpc_port() returned no port", code=port)
        self.session_id = f"{hostname}:{port}"

        self._info: KVAgentInfo | None = None
        self._closed = False
        # per peer: its worker thread and job queue (see _serve)
        self._peer_workers: dict[str, tuple[threading.Thread, queue.SimpleQueue]] = {}
        self._handshaken: set[str] = set()  # peers the engine has a live segment for
        self._state_lock = threading.Lock()
        self._direct_in_flight = 0  # direct engine calls running (close() waits for them)
        self._direct_locks: dict[str, threading.Lock] = {}  # one direct write per peer

    # --- registration ----------------------------------------------------------------
    def register(self, base_addr: int, nbytes: int, layout: KVLayout) -> None:
        if self._closed:
            raise RuntimeError("connector is closed")
        if self._info is not None:
            raise RuntimeError("register() may be called once: the KV buffer is already set")
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if isinstance(base_addr, bool) or not isinstance(base_addr, int) or base_addr <= 0:
            raise ValueError(f"base_addr must be a positive int address, got {base_addr!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if nbytes < layout.total_bytes:
            raise ValueError(
                f"buffer of {nbytes} bytes is smaller than the layout's {layout.num_blocks} "
                f"blocks x {layout.block_bytes} bytes = {layout.total_bytes}"
            )
        rc = self._engine.register_memory(base_addr, nbytes, self.memory_location)
        if rc != 0:
            raise KVTransferError(
                f"Mooncake register_memory(0x{base_addr:x}, {nbytes}) failed", code=rc
            )
        self._info = KVAgentInfo(
            session_id=self.session_id,
            base_addr=base_addr,
            layout=layout,
            backend=self.backend,
            protocol=self.protocol,
        )

    def agent_info(self) -> KVAgentInfo:
        if self._info is None:
            raise RuntimeError("call register() before agent_info() / write_blocks()")
        return self._info

    def _max_region_bytes(self) -> int:
        return self.max_region_bytes

    # --- transfers ---------------------------------------------------------------------
    def _write_regions(
        self, peer: KVAgentInfo, regions: list[tuple[int, int, int]], deadline: float
    ) -> int:
        if self.direct_writes and peer.session_id in self._handshaken:
            return self._write_direct(peer, regions, deadline)
        batches = batched(regions, self.max_batch)
        result: dict[str, Any] = {}
        abandon = threading.Event()
        done = threading.Event()

        def job() -> None:
            # Runs the blocking engine calls on the peer's worker thread; the caller waits
            # for it at most until the deadline. One job at a time per peer keeps one
            # batch per peer in the engine's queue.
            try:
                with self._state_lock:  # atomic with the caller giving up (see below)
                    if abandon.is_set() or time.monotonic() >= deadline:
                        # an earlier, abandoned job held the thread past our deadline
                        result["busy"] = True
                        return
                    result["started"] = True
                if peer.session_id not in self._handshaken:
                    # The engine handshakes with a new peer while holding its global
                    # mutex, so a hung peer would stall transfers to every peer for
                    # 60 s. send_probe takes no such lock: prove the peer answers
                    # first (a hung probe only stalls this peer's thread).
                    rc = self._engine.send_probe(peer.session_id)
                    if rc != 0:
                        result["probe_rc"] = rc
                        return
                for i, batch in enumerate(batches):
                    if abandon.is_set() or time.monotonic() >= deadline:
                        result["late"] = i
                        return
                    rc = self._write_batch(peer.session_id, batch)
                    if rc != 0:
                        result["rc"], result["batch"] = rc, i
                        return
                result["ok"] = True
            except BaseException as exc:  # surfaced to the caller below
                result["exc"] = exc
            finally:
                done.set()

        with self._state_lock:  # so close() cannot queue its sentinel before our job
            if self._closed:
                raise KVTransferError("connector is closed", peer=peer.session_id)
            worker = self._peer_workers.get(peer.session_id)
            if worker is None:
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_serve, args=(jobs,), name=f"kv-write-{peer.session_id}", daemon=True
                )
                thread.start()
                worker = self._peer_workers[peer.session_id] = (thread, jobs)
            worker[1].put(job)
        nbytes = sum(r[2] for r in regions)
        where = f"{len(regions)} regions / {nbytes} bytes in {len(batches)} batches"
        if not done.wait(max(0.0, deadline - time.monotonic())):
            with self._state_lock:
                abandon.set()  # the job, if not started yet, now never starts
                started = "started" in result
            if started:
                raise KVTransferError(
                    f"KV write timed out ({where}); the engine call is abandoned and the "
                    "destination blocks are undefined",
                    peer=peer.session_id,
                    timed_out=True,
                    in_flight=done,
                )
            result["busy"] = True  # still queued behind an earlier transfer
        if result.get("ok"):
            return len(batches)
        if "exc" in result:
            raise KVTransferError(
                f"KV write raised {result['exc']!r} ({where})", peer=peer.session_id
            ) from result["exc"]
        if result.get("busy"):
            raise KVTransferError(
                f"KV write timed out waiting for an earlier transfer to this peer ({where})",
                peer=peer.session_id,
                timed_out=True,
            )
        if "probe_rc" in result:
            raise KVTransferError(
                "Mooncake send_probe failed: peer unreachable or not a Mooncake engine",
                peer=peer.session_id,
                code=result["probe_rc"],
            )
        if "late" in result:
            raise KVTransferError(
                f"KV write timed out after {result['late']} of {len(batches)} batches",
                peer=peer.session_id,
                timed_out=True,
            )
        raise KVTransferError(
            f"Mooncake batch_transfer_sync_write failed on batch {result['batch'] + 1} of "
            f"{len(batches)} ({where})",
            peer=peer.session_id,
            code=result["rc"],
        )

    def _write_batch(self, session_id: str, batch: list[tuple[int, int, int]]) -> int:
        """One blocking engine call for a batch of regions; returns Mooncake's rc."""
        self.faults.delay_write()
        rc = self._engine.batch_transfer_sync_write(
            session_id, [r[0] for r in batch], [r[1] for r in batch], [r[2] for r in batch]
        )
        if rc != 0:
            # Mooncake may have dropped the segment: probe again before the next write
            self._handshaken.discard(session_id)
        else:
            self._handshaken.add(session_id)
        return rc

    def _write_direct(self, peer: KVAgentInfo, regions, deadline: float) -> int:
        batches = batched(regions, self.max_batch)
        with self._state_lock:
            if self._closed:
                raise KVTransferError("connector is closed", peer=peer.session_id)
            lock = self._direct_locks.setdefault(peer.session_id, threading.Lock())
        # One write per peer at a time, as on the worker thread: the engine's sync call
        # spins a core on the transfer status, and the link is shared anyway.
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise KVTransferError(
                "KV write timed out waiting for an earlier transfer to this peer",
                peer=peer.session_id,
                timed_out=True,
            )
        with self._state_lock:
            if self._closed:  # closed while we waited for the lock
                lock.release()
                raise KVTransferError("connector is closed", peer=peer.session_id)
            self._direct_in_flight += 1
        try:
            for i, batch in enumerate(batches):
                if time.monotonic() >= deadline:
                    raise KVTransferError(
                        f"KV write timed out after {i} of {len(batches)} batches",
                        peer=peer.session_id,
                        timed_out=True,
                    )
                rc = self._write_batch(peer.session_id, batch)
                if rc != 0:
                    raise KVTransferError(
                        f"Mooncake batch_transfer_sync_write failed on batch {i + 1} of "
                        f"{len(batches)}",
                        peer=peer.session_id,
                        code=rc,
                    )
            return len(batches)
        finally:
            with self._state_lock:
                self._direct_in_flight -= 1
            lock.release()

    # --- shutdown ------------------------------------------------------------------------
    def close(self, wait_s: float = _CLOSE_WAIT_S) -> None:
        """Unregister the KV buffer and destroy the engine (stops its listeners).

        Every peer's worker thread is told to exit after the jobs already queued. Engine
        calls abandoned after a timeout may still be running on them; destroying the
        engine under them would crash the process, so we wait up to wait_s for the
        threads (and for direct writes still running) and otherwise keep
        the engine alive (leaked, logged) rather than risk it.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            threads = []
            for thread, jobs in self._peer_workers.values():
                jobs.put(None)  # sentinel: _serve returns
                threads.append(thread)
        end = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        while self._direct_in_flight and time.monotonic() < end:
            time.sleep(0.01)
        if any(t.is_alive() for t in threads) or self._direct_in_flight:
            log.warning(
                "closing Mooncake connector %s with engine calls still running; "
                "leaking the engine instead of destroying it under them",
                self.session_id,
            )
            return
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._info is not None:
            rc = engine.unregister_memory(self._info.base_addr)
            if rc != 0:
                log.warning("Mooncake unregister_memory failed rc=%s", rc)
        del engine  # last reference: the engine's destructor closes its sockets

    def __repr__(self) -> str:
        return (
            f"MooncakeConnector(session_id={self.session_id!r}, protocol={self.protocol!r}, "
            f"writes={'direct' if self.direct_writes else 'thread'!r}, "
            f"registered={self._info is not None}, closed={self._closed})"
        )
