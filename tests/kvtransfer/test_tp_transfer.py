"""Real Mooncake transfers over TCP on 127.0.0.1 between workers of different TP degrees.

Every source rank writes into every destination rank; each destination rank must end
up with exactly its heads of the source blocks, nothing written elsewhere, and the bytes
reported by all source ranks must add up to the destination blocks' bytes (each byte
written once).

Each rank is its own KVConnector (its own layout, plan, checks and counters), but the
ranks of one side share one Mooncake engine, each over its own slice of that engine's
registered buffer: destroying an engine takes ~1 s, and one engine per rank would need
32 of them over these cases. Bytes still move through the real engine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")

from kvtransfer import KVAgentInfo, KVConnector, KVLayout, KVLayoutMismatch  # noqa: E402
from kvtransfer.layout import coalesce, kv_heads_of_rank  # noqa: E402
from tests.kvtransfer.test_mooncake import SMALL, Worker  # noqa: E402

# per head and block: 2 layers x (K,V) x 4 tokens x 8 dims x 4 bytes = 512 bytes
DIMS = dict(block_size=4, num_layers=2, head_dim=8, dtype="float32")
SHAPE = (DIMS["num_layers"], 2, DIMS["block_size"], DIMS["head_dim"])
SRC_BLOCKS, DST_BLOCKS = 12, 16
# a run consecutive on both sides, an isolated block, a second run, unsorted
SRC_IDS = [0, 1, 2, 5, 10, 9, 11]
DST_IDS = [3, 4, 5, 12, 8, 7, 9]
HOST_BLOCKS = 64  # of SMALL's 1 KiB: room for 4 ranks of up to 4 heads on either side


class RankView(KVConnector):
    """One TP rank: a slice of a host connector's registered buffer, writing through
    the host's engine."""

    backend = "mooncake"

    def __init__(self, host: Worker, offset: int, layout: KVLayout):
        super().__init__()
        self._host = host.conn
        self._info = KVAgentInfo(
            host.info.session_id, host.info.base_addr + offset, layout, protocol="tcp"
        )

    def register(self, base_addr, nbytes, layout):
        raise NotImplementedError("a view of the host's registered buffer")

    def agent_info(self) -> KVAgentInfo:
        return self._info

    def close(self) -> None:
        pass  # the host owns the engine

    def _write_regions(self, peer, regions, deadline):
        return self._host._write_regions(peer, regions, deadline)

    def _max_region_bytes(self) -> int:
        return self._host._max_region_bytes()


@pytest.fixture(scope="module")
def hosts():
    src = Worker(HOST_BLOCKS, seed=21, layout_kw=SMALL)
    dst = Worker(HOST_BLOCKS, seed=22, layout_kw=SMALL)
    yield src, dst
    src.conn.close()
    dst.conn.close()


def rank_layouts(tp: int, total: int, num_blocks: int) -> list[KVLayout]:
    return [
        KVLayout(
            num_blocks=num_blocks,
            num_kv_heads=len(kv_heads_of_rank(total, tp, r)),
            tp_size=tp,
            tp_rank=r,
            total_kv_heads=total,
            **DIMS,
        )
        for r in range(tp)
    ]


def rank_views(host: Worker, layouts: list[KVLayout]) -> tuple[list[RankView], np.ndarray]:
    """A view per rank, one after the other in the host's buffer (zeroed), and an int32
    array over each rank's [blocks, heads, layers, 2, tokens, dims] tensor."""
    host.buf[:] = 0
    views, tensors, offset = [], [], 0
    for lay in layouts:
        views.append(RankView(host, offset, lay))
        raw = host.buf[offset : offset + lay.total_bytes].view(np.int32)
        tensors.append(raw.reshape(lay.num_blocks, lay.num_kv_heads, *SHAPE))
        offset += lay.total_bytes
    assert offset <= host.buf.nbytes
    return views, tensors


@pytest.mark.parametrize(
    "p_tp,d_tp,total",
    [(1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 4), (2, 2, 4), (1, 4, 2), (4, 1, 2)],
)
def test_every_destination_head_lands_once(hosts, p_tp, d_tp, total):
    src_host, dst_host = hosts
    # every element of the model's full KV is unique: (block, head, layer, k/v, token,
    # dim) -> a distinct nonzero int, so a misplaced or missing byte shows
    ref = np.arange(1, SRC_BLOCKS * total * np.prod(SHAPE) + 1, dtype=np.int32)
    ref = ref.reshape(SRC_BLOCKS, total, *SHAPE)
    p_lays = rank_layouts(p_tp, total, SRC_BLOCKS)
    d_lays = rank_layouts(d_tp, total, DST_BLOCKS)
    writers, p_kv = rank_views(src_host, p_lays)
    readers, d_kv = rank_views(dst_host, d_lays)
    for lay, kv in zip(p_lays, p_kv):
        kv[:] = ref[:, lay.kv_heads.start : lay.kv_heads.stop]

    written = 0
    for w in writers:
        sent = 0
        for r in readers:
            peer = r.agent_info()
            stats = w.write_blocks(peer, SRC_IDS, DST_IDS, timeout_s=20)
            written += stats.bytes
            sent += stats.bytes > 0
            same_heads = w.layout.kv_heads == peer.layout.kv_heads
            if stats.bytes == 0:
                assert stats.num_regions == stats.num_batches == stats.num_blocks == 0
            elif same_heads:  # whole blocks: runs coalesce as without TP
                assert stats.num_regions == len(coalesce(SRC_IDS, DST_IDS))
            else:  # a head range per block
                assert stats.num_regions == len(SRC_IDS)
        assert w.stats()["transfers_ok"] == sent  # a rank owning no heads sends nothing

    expected_bytes = sum(len(DST_IDS) * lay.block_bytes for lay in d_lays)
    assert written == expected_bytes  # with every byte present below: each written once
    for lay, kv in zip(d_lays, d_kv):
        want = np.zeros_like(kv)
        want[DST_IDS] = ref[SRC_IDS][:, lay.kv_heads.start : lay.kv_heads.stop]
        assert np.array_equal(kv, want), f"dst rank {lay.tp_rank} of TP {d_tp}"
    used = sum(lay.total_bytes for lay in d_lays)
    assert not dst_host.buf[used:].any()  # nothing past the ranks' buffers
    # the source buffers are only read
    for lay, kv in zip(p_lays, p_kv):
        assert np.array_equal(kv, ref[:, lay.kv_heads.start : lay.kv_heads.stop])


def test_rank_without_heads_sends_nothing_but_still_validates(hosts):
    src_host, dst_host = hosts
    writers, _ = rank_views(src_host, rank_layouts(4, 2, SRC_BLOCKS))
    readers, _ = rank_views(dst_host, rank_layouts(1, 2, DST_BLOCKS))
    replica, peer = writers[1], readers[0].agent_info()  # rank 0 writes head 0
    stats = replica.write_blocks(peer, [0, 1], [2, 3], timeout_s=5)
    assert (stats.bytes, stats.num_blocks, stats.num_regions) == (0, 0, 0)
    assert replica.stats()["transfers_ok"] == 0  # the backend was never called
    with pytest.raises(ValueError, match="dst block 16 out of range"):
        replica.write_blocks(peer, [0], [DST_BLOCKS])
    other_model = KVAgentInfo(
        peer.session_id, peer.base_addr, rank_layouts(1, 4, DST_BLOCKS)[0], protocol="tcp"
    )
    with pytest.raises(KVLayoutMismatch, match="total_kv_heads") as err:
        replica.add_peer(other_model)
    assert err.value.fields == ("total_kv_heads",)
