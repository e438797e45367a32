"""Real Mooncake transfers over TCP on 127.0.0.1 (two engines in this process).

Checks bytes exactly (per-block checksums), that untouched blocks stay untouched, that
big scattered writes are chunked below the TCP per-peer queue limit, and that dead or
hung peers raise KVTransferError within the timeout instead of hanging.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")

from kvtransfer import (  # noqa: E402
    KVAgentInfo,
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    create_connector,
)
from kvtransfer.mooncake import MooncakeConnector  # noqa: E402

# 1 KiB blocks: 2 layers x (K,V) x 4 tokens x 2 heads x 8 dims x 4 bytes.
SMALL = dict(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
WRITER_BLOCKS = 2304
READER_BLOCKS = 4608  # room for > 2048 isolated (every other) destination blocks


class Worker:
    """A connector plus the numpy buffer it registered (kept alive with it)."""

    def __init__(self, num_blocks: int, seed: int, layout_kw: dict | None = None, **kw):
        self.layout = KVLayout(num_blocks=num_blocks, **(layout_kw or SMALL))
        self.buf = np.random.default_rng(seed).integers(
            0, 256, self.layout.total_bytes, dtype=np.uint8
        )
        self.conn = create_connector("mooncake", hostname="127.0.0.1", **kw)
        self.conn.register(self.buf.ctypes.data, self.buf.nbytes, self.layout)

    @property
    def info(self) -> KVAgentInfo:
        return self.conn.agent_info()

    def block(self, i: int) -> bytes:
        bb = self.layout.block_bytes
        return self.buf[i * bb : (i + 1) * bb].tobytes()

    def digests(self) -> list[bytes]:
        bb = self.layout.block_bytes
        view = self.buf.reshape(self.layout.num_blocks, bb)
        return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in view]


@pytest.fixture(scope="module")
def pair():
    writer = Worker(WRITER_BLOCKS, seed=1)
    reader = Worker(READER_BLOCKS, seed=2)
    writer.conn.add_peer(reader.info)
    yield writer, reader
    writer.conn.close()
    reader.conn.close()


def within(seconds: float, fn, *args, **kwargs):
    """Run fn in a thread; fail (instead of hanging the suite) if it takes too long."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed back to the test
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"call still running after {seconds}s"
    box["elapsed"] = time.monotonic() - start
    return box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_copied(writer: Worker, reader: Worker, before: list[bytes], src, dst):
    after = reader.digests()
    src_digests = writer.digests()
    mapping = dict(zip(dst, src))
    for i, digest in enumerate(after):
        if i in mapping:
            assert digest == src_digests[mapping[i]], f"dst block {i} != src {mapping[i]}"
        else:
            assert digest == before[i], f"untouched dst block {i} changed"


def test_agent_info_session_id_and_roundtrip(pair):
    writer, reader = pair
    info = reader.info
    assert info.session_id.startswith("127.0.0.1:") and info.port > 0
    assert info.base_addr == reader.buf.ctypes.data
    assert info.layout == reader.layout and info.backend == "mooncake"
    assert KVAgentInfo.from_json(info.to_json()) == info
    assert writer.info.session_id != info.session_id


def test_scattered_write_is_exact(pair):
    writer, reader = pair
    before = reader.digests()
    # runs on both sides, a run that is consecutive only on one side, isolated blocks,
    # unsorted order
    src = [5, 6, 7, 8, 100, 101, 102, 300, 301, 50, 2000, 9, 1234]
    dst = [10, 11, 12, 13, 500, 501, 502, 700, 900, 60, 4600, 14, 0]
    stats = writer.conn.write_blocks(reader.info, src, dst, timeout_s=20)
    assert stats.num_blocks == len(src)
    assert stats.bytes == len(src) * writer.layout.block_bytes
    assert stats.num_regions == 7  # 5..9->10..14, 100..102, 300, 301, 50, 2000, 1234
    assert stats.num_batches == 1 and stats.seconds > 0
    assert_copied(writer, reader, before, src, dst)
    assert reader.block(0) == writer.block(1234)


def test_more_than_2048_isolated_blocks_are_chunked(pair):
    writer, reader = pair
    before = reader.digests()
    src = list(range(0, 2 * 1100, 2)) + list(range(1, 2 * 1100, 2))[:1000]  # 2100 blocks
    dst = list(range(1, 2 * 2100, 2))  # every other block: nothing coalesces
    stats = writer.conn.write_blocks(reader.info, src, dst, timeout_s=30)
    assert stats.num_regions == 2100
    assert stats.num_batches == 5  # max_batch 512
    assert_copied(writer, reader, before, src, dst)


def test_large_regions_are_split_and_exact():
    layout_kw = dict(SMALL, block_size=64)  # 16 KiB blocks
    writer = Worker(64, seed=3, layout_kw=layout_kw, max_region_bytes=40_000)
    reader = Worker(96, seed=4, layout_kw=layout_kw)
    try:
        before = reader.digests()
        src, dst = list(range(0, 40)), list(range(50, 90))
        stats = writer.conn.write_blocks(reader.info, src, dst, timeout_s=20)
        assert stats.num_regions == -(-40 * 16384 // 40_000)  # one run split in 17
        assert_copied(writer, reader, before, src, dst)
        assert writer.conn.write_blocks(reader.info, [], []).bytes == 0
    finally:
        writer.conn.close()
        reader.conn.close()


def test_incompatible_peer_rejected_at_add_peer(pair):
    writer, _ = pair
    other = Worker(8, seed=5, layout_kw=dict(SMALL, dtype="float16", head_dim=16))
    try:
        with pytest.raises(KVLayoutMismatch) as err:
            writer.conn.add_peer(other.info)
        assert set(err.value.fields) == {"dtype", "head_dim"}
        assert other.info.session_id in str(err.value)
        # write_blocks runs the same check before touching the network
        with pytest.raises(KVLayoutMismatch):
            writer.conn.write_blocks(other.info, [0], [0])
        assert other.info.session_id not in [p.session_id for p in writer.conn.peers()]
    finally:
        other.conn.close()


def test_bad_block_ids_raise_before_sending(pair):
    writer, reader = pair
    with pytest.raises(ValueError, match="dst block 4608 out of range"):
        writer.conn.write_blocks(reader.info, [0], [READER_BLOCKS])
    with pytest.raises(ValueError, match="src block 2304 out of range"):
        writer.conn.write_blocks(reader.info, [WRITER_BLOCKS], [0])
    with pytest.raises(ValueError, match="duplicate"):
        writer.conn.write_blocks(reader.info, [0, 1], [3, 3])
    with pytest.raises(ValueError, match="timeout_s"):
        writer.conn.write_blocks(reader.info, [0], [0], timeout_s=0)


def test_peer_that_never_existed_raises(pair):
    writer, _ = pair
    ghost = KVAgentInfo(f"127.0.0.1:{free_port()}", 1 << 32, writer.layout)
    failed_before = writer.conn.stats()["transfers_failed"]
    box = within(30, writer.conn.write_blocks, ghost, [0, 1, 2], [0, 1, 2], timeout_s=5)
    exc = box.get("exc")
    assert isinstance(exc, KVTransferError), box
    assert ghost.session_id in str(exc) and exc.peer == ghost.session_id
    assert box["elapsed"] < 10
    assert writer.conn.stats()["transfers_failed"] == failed_before + 1


def test_peer_that_closed_raises():
    writer = Worker(16, seed=6)
    reader = Worker(16, seed=7)
    try:
        writer.conn.write_blocks(reader.info, [1], [2], timeout_s=10)
        assert reader.block(2) == writer.block(1)
        info = reader.info
        reader.conn.close()
        box = within(30, writer.conn.write_blocks, info, [3], [4], timeout_s=5)
        assert isinstance(box.get("exc"), KVTransferError), box
        assert box["exc"].code == -1 or box["exc"].timed_out
    finally:
        writer.conn.close()
        reader.conn.close()


def test_hung_peer_times_out_without_blocking_other_peers(pair):
    # A listener that accepts TCP connections but never answers: Mooncake's handshake
    # would wait 60 s for it; write_blocks must give up at its own deadline.
    _, reader = pair
    writer = Worker(16, seed=8)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    hung = KVAgentInfo(f"127.0.0.1:{silent.getsockname()[1]}", 1 << 32, writer.layout)
    try:
        box = within(30, writer.conn.write_blocks, hung, [0], [0], timeout_s=1.0)
        exc = box.get("exc")
        assert isinstance(exc, KVTransferError) and exc.timed_out, box
        assert hung.session_id in str(exc)
        # the abandoned call still owns that peer: the next write fails fast too
        box = within(30, writer.conn.write_blocks, hung, [1], [1], timeout_s=0.5)
        assert isinstance(box.get("exc"), KVTransferError) and box["exc"].timed_out
        # other peers are unaffected
        before = reader.digests()
        writer.conn.write_blocks(reader.info, [3, 4], [4000, 4001], timeout_s=10)
        assert_copied(writer, reader, before, [3, 4], [4000, 4001])
        stats = writer.conn.stats()
        assert stats["transfers_timed_out"] == 2 and stats["transfers_ok"] == 1
    finally:
        silent.close()  # resets the pending handshake so the abandoned call returns
        box = within(30, writer.conn.close)
        assert "exc" not in box, box
        assert writer.conn._engine is None  # destroyed, not leaked behind a live call


def test_concurrent_writes_to_one_peer(pair):
    writer, reader = pair
    before = reader.digests()
    jobs = [
        (list(range(i * 40, i * 40 + 40, 2)), list(range(3000 + i * 40, 3020 + i * 40)))
        for i in range(4)
    ]
    boxes: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda s=s, d=d: boxes.append(
                within(30, writer.conn.write_blocks, reader.info, s, d, timeout_s=20)
            )
        )
        for s, d in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert len(boxes) == 4 and all("exc" not in b for b in boxes), boxes
    src = [b for s, _ in jobs for b in s]
    dst = [b for _, d in jobs for b in d]
    assert_copied(writer, reader, before, src, dst)


def test_writes_to_a_peer_share_one_long_lived_thread():
    # nvlink_intra caches a CUDA stream per calling thread (~1 ms to set up), so each
    # peer's writes run on one worker thread that outlives the write; close() stops it.
    writer = Worker(16, seed=9)
    reader = Worker(16, seed=10)
    name = f"kv-write-{reader.info.session_id}"
    try:
        for i in range(3):
            writer.conn.write_blocks(reader.info, [i], [i + 4], timeout_s=10)
            assert reader.block(i + 4) == writer.block(i)
        threads = [t for t in threading.enumerate() if t.name == name]
        assert len(threads) == 1 and threads[0].daemon
    finally:
        writer.conn.close()
        reader.conn.close()
    assert not threads[0].is_alive()
    assert writer.conn._engine is None
    with pytest.raises(KVTransferError, match="closed"):
        writer.conn.write_blocks(reader.info, [0], [0], timeout_s=1)


def test_stats_counters(pair):
    writer, reader = pair
    before = writer.conn.stats()
    s = writer.conn.write_blocks(reader.info, [10, 11], [20, 21], timeout_s=10)
    after = writer.conn.stats()
    assert after["transfers_ok"] == before["transfers_ok"] + 1
    assert after["bytes"] == before["bytes"] + s.bytes
    assert after["blocks"] == before["blocks"] + 2
    assert after["regions"] == before["regions"] + 1
    assert after["seconds"] > before["seconds"]


def test_register_validation_and_close_is_idempotent():
    layout = KVLayout(num_blocks=4, **SMALL)
    buf = np.zeros(layout.total_bytes, dtype=np.uint8)
    conn = MooncakeConnector("127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="register"):
            conn.agent_info()
        with pytest.raises(ValueError, match="smaller"):
            conn.register(buf.ctypes.data, buf.nbytes - 1, layout)
        conn.register(buf.ctypes.data, buf.nbytes, layout)
        with pytest.raises(RuntimeError, match="once"):
            conn.register(buf.ctypes.data, buf.nbytes, layout)
    finally:
        conn.close()
        conn.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"protocol": "udp"}, "unknown protocol"),
        ({"max_batch": 4096}, "queue limit"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_region_bytes": 0}, "max_region_bytes"),
        ({"hostname": "127.0.0.1:1234"}, "without port"),
        ({"direct_writes": "yes"}, "direct_writes"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MooncakeConnector(**kwargs)


def test_direct_writes_after_first_contact(pair):
    """direct_writes: the first write to a peer goes through its worker thread (probe and
    handshake), later ones call the engine from the calling thread, batch by batch."""
    _, reader = pair
    writer = Worker(256, seed=11, direct_writes=True, max_batch=2)
    name = f"kv-write-{reader.info.session_id}"
    try:
        assert MooncakeConnector(protocol="tcp").direct_writes is False  # the default
        before = reader.digests()
        workers = len([t for t in threading.enumerate() if t.name == name])  # pair's own
        writer.conn.write_blocks(reader.info, [0], [4100], timeout_s=10)
        assert len([t for t in threading.enumerate() if t.name == name]) == workers + 1
        src = [5, 6, 7, 100, 9, 200, 201]
        dst = [4200, 4201, 4202, 4300, 4400, 4500, 4502]
        calls = []
        writer.conn._engine = _Spy(writer.conn._engine, calls)
        stats = writer.conn.write_blocks(reader.info, src, dst, timeout_s=10)
        assert (stats.num_regions, stats.num_batches) == (5, 3)
        assert [c[0] for c in calls] == [threading.current_thread().name] * 3
        assert [len(c[1][1]) for c in calls] == [2, 2, 1]
        assert_copied(writer, reader, before, [0] + src, [4100] + dst)
        # concurrent direct writes to one peer
        boxes = []
        jobs = [
            (list(range(i * 8, i * 8 + 8)), list(range(4600 - i * 8, 4608 - i * 8)))
            for i in range(4)
        ]
        threads = [
            threading.Thread(
                target=lambda s=s, d=d: boxes.append(
                    within(30, writer.conn.write_blocks, reader.info, s, d, timeout_s=20)
                )
            )
            for s, d in jobs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert len(boxes) == 4 and all("exc" not in b for b in boxes), boxes
        for s_ids, d_ids in jobs:
            assert all(reader.block(d) == writer.block(b) for b, d in zip(s_ids, d_ids))
    finally:
        box = within(30, writer.conn.close)
        assert "exc" not in box and writer.conn._engine is None


def test_direct_write_to_a_closed_peer_raises_and_reprobes():
    writer = Worker(16, seed=12, direct_writes=True)
    reader = Worker(16, seed=13)
    try:
        writer.conn.write_blocks(reader.info, [1], [2], timeout_s=10)
        assert reader.info.session_id in writer.conn._handshaken
        info = reader.info
        reader.conn.close()
        box = within(30, writer.conn.write_blocks, info, [3], [4], timeout_s=5)
        assert isinstance(box.get("exc"), KVTransferError), box
        assert info.session_id not in writer.conn._handshaken  # next write probes first
        box = within(30, writer.conn.write_blocks, info, [3], [4], timeout_s=2)
        assert isinstance(box.get("exc"), KVTransferError), box
        assert writer.conn.stats()["transfers_failed"] >= 2
    finally:
        box = within(30, writer.conn.close)
        assert "exc" not in box, box


class _Spy:
    """Records which thread makes each engine write call (a test double for nothing but
    the bookkeeping: every call goes to the real engine)."""

    def __init__(self, engine, calls):
        self._engine, self._calls = engine, calls

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_transfer_sync_write(self, *args):
        self._calls.append((threading.current_thread().name, args))
        return self._engine.batch_transfer_sync_write(*args)


def test_direct_writes_wait_their_turn_per_peer_within_the_deadline():
    """One direct write per peer at a time: a write that cannot get its turn before its
    deadline times out without touching the peer, and one still waiting when the
    connector closes fails instead of calling a destroyed engine."""
    writer = Worker(16, seed=14, direct_writes=True)
    reader = Worker(16, seed=15)
    try:
        writer.conn.write_blocks(reader.info, [1], [2], timeout_s=10)  # first contact
        before = reader.digests()
        turn = writer.conn._direct_locks.setdefault(reader.info.session_id, threading.Lock())
        turn.acquire()  # an earlier write to this peer is running
        box = within(30, writer.conn.write_blocks, reader.info, [3], [4], timeout_s=0.3)
        assert isinstance(box.get("exc"), KVTransferError) and box["exc"].timed_out, box
        assert "earlier transfer" in str(box["exc"])
        assert reader.digests() == before
        waiting: dict = {}
        t = threading.Thread(
            target=lambda: waiting.update(
                within(30, writer.conn.write_blocks, reader.info, [5], [6], timeout_s=20)
            )
        )
        t.start()
        time.sleep(0.2)
        closed = within(30, writer.conn.close)
        assert "exc" not in closed and writer.conn._engine is None
        turn.release()
        t.join(30)
        assert isinstance(waiting.get("exc"), KVTransferError), waiting
        assert "closed" in str(waiting["exc"])
        assert reader.digests() == before
    finally:
        within(30, writer.conn.close)
        within(30, reader.conn.close)


def test_a_write_walked_away_from_reports_when_it_has_landed():
    """A write past its deadline still lands later (the injected delay stands for a slow
    link): the error carries an event that is set only once the engine call is over, so
    a caller can wait until nothing more can land."""
    from kvtransfer.faults import TransferFaults

    writer = Worker(8, seed=5, faults=TransferFaults(write_delay_s=1.5))
    reader = Worker(8, seed=6)
    try:
        before = reader.digests()
        with pytest.raises(KVTransferError) as err:
            writer.conn.write_blocks(reader.info, [0, 1], [4, 5], timeout_s=0.3)
        assert err.value.timed_out and err.value.in_flight is not None
        assert not err.value.in_flight.is_set()
        assert reader.digests() == before  # not yet
        assert err.value.in_flight.wait(10)
        assert_copied(writer, reader, before, [0, 1], [4, 5])  # landed after the error
    finally:
        writer.conn.close()
        reader.conn.close()


def test_transfer_faults_from_env(monkeypatch):
    from kvtransfer.faults import WRITE_DELAY_ENV, TransferFaults

    monkeypatch.delenv(WRITE_DELAY_ENV, raising=False)
    assert not TransferFaults.from_env().active
    monkeypatch.setenv(WRITE_DELAY_ENV, "2.5")
    assert TransferFaults.from_env().write_delay_s == 2.5
    monkeypatch.setenv(WRITE_DELAY_ENV, "soon")
    with pytest.raises(ValueError, match=WRITE_DELAY_ENV):
        TransferFaults.from_env()
    with pytest.raises(ValueError, match="write_delay_s"):
        TransferFaults(write_delay_s=-1)
