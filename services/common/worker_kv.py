"""A worker's KV transfer over all its tensor-parallel ranks.

Each rank registers its own KV memory with its own transfer engine (rank 0 here, the
others in their processes through the ranks' side channel), so a worker has one agent
per rank. A peer is known by its rank 0's session id and holds the agents of all its
ranks. A write of a request's blocks runs on every rank at once: each writes the KV
heads it is responsible for into every peer rank holding them (kvtransfer/tp_plan.py),
and the write is done when every rank's is. Without TP this is rank 0's connector."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from kvtransfer import KVAgentInfo, KVConnector, KVTransferError, TransferStats
from kvtransfer.layout import KVLayoutMismatch
from kvtransfer.tp_plan import check_tp_pair
from services.common.kv import register_kv_cache

_COUNTERS = ("transfers_ok", "transfers_failed", "transfers_timed_out", "bytes", "blocks")


def register_rank_kv(state: dict, make_connector, connector_kwargs: dict) -> dict:
    """Side call on rank r: register the rank's KV memory with a transfer engine of
    its own; returns its agent info (as a dict: it crosses the pipe)."""
    from services.common.kv import memory_location

    runner = state["runner"]
    kwargs = dict(connector_kwargs, memory_location=memory_location(runner.kv_cache))
    connector = make_connector(**kwargs)
    register_kv_cache(connector, runner.kv_cache, runner.kv_spec)
    state["connector"] = connector
    return connector.agent_info().to_dict()


def write_rank_kv(state: dict, peers: list[dict], src, dst, timeout_s: float) -> dict:
    """Side call on rank r: write this rank's heads of blocks src into each peer rank's
    blocks dst; returns the summed TransferStats as a dict."""
    connector: KVConnector = state["connector"]
    stats = [connector.write_blocks(KVAgentInfo.from_dict(p), src, dst, timeout_s) for p in peers]
    return _sum(stats).__dict__


def _sum(stats: list[TransferStats]) -> TransferStats:
    return TransferStats(
        bytes=sum(s.bytes for s in stats),
        num_blocks=max((s.num_blocks for s in stats), default=0),
        num_regions=sum(s.num_regions for s in stats),
        num_batches=sum(s.num_batches for s in stats),
        seconds=max((s.seconds for s in stats), default=0.0),
    )


class WorkerKV:
    """What the services use: agent_info / add_peer / peers / write_blocks / stats /
    close, over every rank. ranks: the engine runner's TPRanks, or None without TP."""

    def __init__(self, local: KVConnector, ranks=None, make_connector=None, kwargs=None):
        self.local = local
        self._ranks = ranks
        self.rank_agents: list[KVAgentInfo] = [local.agent_info()]
        if ranks is not None:
            futures = [
                ranks.side_call(r, register_rank_kv, make_connector, kwargs)
                for r in range(1, len(ranks.procs) + 1)
            ]
            self.rank_agents += [KVAgentInfo.from_dict(f.result(120)) for f in futures]
        self._lock = threading.Lock()
        self._groups: dict[str, list[KVAgentInfo]] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def agent_info(self) -> KVAgentInfo:
        return self.rank_agents[0]

    def add_peer(self, info: KVAgentInfo, rank_agents: list[KVAgentInfo] | None = None):
        """Check a peer worker (its rank 0 `info` and all its ranks' agents, rank order)
        against every rank here; raises KVLayoutMismatch naming what disagrees."""
        group = list(rank_agents) if rank_agents else [info]
        if group[0].session_id != info.session_id:
            raise ValueError("the peer's first rank agent must be its rank 0")
        layouts = [a.layout for a in group]
        if [lay.tp_rank for lay in layouts] != list(range(layouts[0].tp_size)):
            raise KVLayoutMismatch(
                f"peer {info.session_id} sent agents of ranks "
                f"{[lay.tp_rank for lay in layouts]} for tp_size {layouts[0].tp_size}",
                ("tp_rank",),
            )
        mine = self.agent_info().layout
        check_tp_pair(mine.tp_size, layouts[0].tp_size, mine.total_kv_heads)
        for agent in group:
            self.local.add_peer(agent)  # layout compatibility, backend and protocol
        with self._lock:
            self._groups[info.session_id] = group

    def peers(self) -> list[KVAgentInfo]:
        with self._lock:
            return [g[0] for g in self._groups.values()]

    def write_blocks(self, peer: KVAgentInfo, src, dst, timeout_s: float = 30.0) -> TransferStats:
        """Every rank writes its part of blocks src into the peer's blocks dst; returns
        once all have (TransferStats summed over ranks), or raises KVTransferError once
        no rank can still be writing."""
        with self._lock:
            group = self._groups.get(peer.session_id, [peer])
        if self._ranks is None and len(group) == 1:  # one rank each side: the plain write
            try:
                stats = self.local.write_blocks(group[0], src, dst, timeout_s)
            except KVTransferError as e:
                self._count(failed=True, timed_out=e.timed_out)
                raise
            self._count(stats)
            return stats
        started = time.monotonic()
        remote = []
        if self._ranks is not None:
            dicts = [a.to_dict() for a in group]
            remote = [
                self._ranks.side_call(r, write_rank_kv, dicts, list(src), list(dst), timeout_s)
                for r in range(1, len(self._ranks.procs) + 1)
            ]
        stats, error = [], None
        try:
            stats = [self.local.write_blocks(p, src, dst, timeout_s) for p in group]
        except KVTransferError as e:
            error = e
        # the other ranks' writes end within their own timeout (plus the side pipe)
        for future in remote:
            try:
                stats.append(TransferStats(**future.result(timeout_s + 60)))
            except (concurrent.futures.TimeoutError, RuntimeError) as e:
                error = error or KVTransferError(
                    f"a rank's KV write failed: {e}", peer=peer.session_id
                )
        if error is not None:
            self._count(failed=True, timed_out=error.timed_out)
            raise error
        total = _sum(stats)
        total = TransferStats(
            total.bytes, len(src), total.num_regions, total.num_batches, time.monotonic() - started
        )
        self._count(total)
        return total

    def _count(self, stats: TransferStats | None = None, failed=False, timed_out=False) -> None:
        with self._lock:
            c = self._counters
            if failed:
                c["transfers_failed"] += 1
                c["transfers_timed_out"] += int(timed_out)
            if stats is not None:
                c["transfers_ok"] += 1
                c["bytes"] += stats.bytes
                c["blocks"] += stats.num_blocks

    def stats(self) -> dict[str, float]:
        """Per request write (all ranks together): transfers_ok / failed / timed_out,
        bytes, blocks."""
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        self.local.close()  # the other ranks' engines end with their processes

    def __repr__(self) -> str:
        return f"WorkerKV({self.local!r}, ranks={len(self.rank_agents)})"
