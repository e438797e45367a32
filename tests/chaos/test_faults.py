"""The fault points themselves (kvtransfer/faults.py): off unless their variable is
set, read from the environment, firing exactly when they say, never silently (a WARNING
line and a count each time), and wired into the connector: a failed write or handshake
is a KVTransferError, counted in the connector's stats, with real Mooncake engines."""

from __future__ import annotations

import logging
import pickle

import pytest

from kvtransfer.faults import (
    FAIL_EVERY_NTH_WRITE_ENV,
    FAIL_HANDSHAKES_ENV,
    STALL_AFTER_PREFILL_ENV,
    STALL_BEFORE_PREFILL_ENV,
    WRITE_DELAY_ENV,
    PrefillStalls,
    TransferFaults,
)

ALL_ENV = (
    WRITE_DELAY_ENV,
    FAIL_EVERY_NTH_WRITE_ENV,
    FAIL_HANDSHAKES_ENV,
    STALL_BEFORE_PREFILL_ENV,
    STALL_AFTER_PREFILL_ENV,
)


def test_off_unless_set(monkeypatch, caplog):
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    faults, stalls = TransferFaults.from_env(), PrefillStalls.from_env()
    assert not faults.active and not stalls.active
    with caplog.at_level(logging.DEBUG, logger="kvtransfer.faults"):
        assert faults.delay_write() == 0.0
        assert not any(faults.fail_write("p") for _ in range(50))
        assert not any(faults.fail_handshake("p") for _ in range(50))
        assert stalls.stall("before", "r") == stalls.stall("after", "r") == 0.0
    assert caplog.records == [] and faults.fired == {} and stalls.fired == {}


def test_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(FAIL_EVERY_NTH_WRITE_ENV, "7")
    monkeypatch.setenv(FAIL_HANDSHAKES_ENV, "2")
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.5")
    monkeypatch.setenv(STALL_BEFORE_PREFILL_ENV, "1.5")
    monkeypatch.setenv(STALL_AFTER_PREFILL_ENV, "0.25")
    faults = TransferFaults.from_env()
    assert (faults.fail_every_nth_write, faults.fail_handshakes, faults.write_delay_s) == (
        7,
        2,
        0.5,
    )
    assert faults.active
    stalls = PrefillStalls.from_env()
    assert (stalls.before_s, stalls.after_s) == (1.5, 0.25) and stalls.active
    for name, bad in ((FAIL_EVERY_NTH_WRITE_ENV, "often"), (FAIL_HANDSHAKES_ENV, "1.5")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            TransferFaults.from_env()
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv(STALL_AFTER_PREFILL_ENV, "later")
    with pytest.raises(ValueError, match=STALL_AFTER_PREFILL_ENV):
        PrefillStalls.from_env()
    with pytest.raises(ValueError, match="fail_every_nth_write"):
        TransferFaults(fail_every_nth_write=-1)
    with pytest.raises(ValueError, match="fail_handshakes"):
        TransferFaults(fail_handshakes=True)
    with pytest.raises(ValueError, match="before_s"):
        PrefillStalls(before_s=-1)


def test_every_nth_write_and_first_handshakes_fire_loudly(caplog):
    faults = TransferFaults(fail_every_nth_write=7, fail_handshakes=2)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.faults"):
        writes = [faults.fail_write("peer:1") for _ in range(30)]
        shakes = [faults.fail_handshake("peer:1") for _ in range(5)]
    assert [i + 1 for i, failed in enumerate(writes) if failed] == [7, 14, 21, 28]
    assert shakes == [True, True, False, False, False]
    assert faults.fired == {"fail_write": 4, "fail_handshake": 2}
    lines = [r.getMessage() for r in caplog.records]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert lines[0] == "fault injection: failing KV write 7 to peer:1 (every 7th; #1)"
    assert lines[3] == "fault injection: failing KV write 28 to peer:1 (every 7th; #4)"
    assert lines[4].startswith("fault injection: failing handshake 1 with peer:1")
    assert len(lines) == 6


def test_stalls_and_delay_are_logged_and_counted(caplog):
    stalls = PrefillStalls(before_s=0.2)
    faults = TransferFaults(write_delay_s=0.01)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.faults"):
        assert stalls.stall("before", "req-1") == 0.2
        assert stalls.stall("after", "req-1") == 0.0  # not set: silent
        assert faults.delay_write() == 0.01
    assert stalls.fired == {"stall_before_prefill": 1}
    assert faults.fired == {"write_delay": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "fault injection: stalling request req-1 0.20s before prefill (#1)",
        "fault injection: delaying a write by 0.01s (#1)",
    ]
    with pytest.raises(ValueError, match="when"):
        stalls.stall("during", "req-1")


def test_faults_travel_to_rank_processes():
    """Tensor-parallel ranks get the worker's connector arguments through a pipe: the
    faults pickle, and a copy counts from zero."""
    faults = TransferFaults(fail_every_nth_write=2)
    assert faults.fail_write("p") is False
    copy = pickle.loads(pickle.dumps(faults))
    assert copy == faults and copy.fired == {}
    assert [copy.fail_write("p") for _ in range(2)] == [False, True]


def test_connector_write_and_handshake_faults_with_real_engines():
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    from kvtransfer import KVTransferError
    from tests.kvtransfer.test_mooncake import Worker, assert_copied

    writer = Worker(8, seed=3, faults=TransferFaults(fail_every_nth_write=2, fail_handshakes=1))
    reader = Worker(8, seed=4)
    try:
        with pytest.raises(KVTransferError, match="fault injection: handshake failed"):
            writer.conn.add_peer(reader.info)
        assert writer.conn.peers() == []
        writer.conn.add_peer(reader.info)  # the second handshake goes through
        before = reader.digests()
        writer.conn.write_blocks(reader.info, [0, 1], [4, 5], timeout_s=10)
        assert_copied(writer, reader, before, [0, 1], [4, 5])
        before = reader.digests()
        with pytest.raises(KVTransferError, match="fault injection: KV write failed") as err:
            writer.conn.write_blocks(reader.info, [2], [6], timeout_s=10)
        assert not err.value.timed_out and err.value.peer == reader.info.session_id
        assert reader.digests() == before  # nothing was sent
        writer.conn.write_blocks(reader.info, [2], [6], timeout_s=10)  # the third is fine
        stats = writer.conn.stats()
        assert (stats["transfers_ok"], stats["transfers_failed"]) == (2, 1)
        assert writer.conn.faults.fired == {"fail_handshake": 1, "fail_write": 1}
    finally:
        writer.conn.close()
        reader.conn.close()


def test_a_failed_handshake_on_the_decode_side_falls_back_per_policy(model, colocated):
    """Our own side of the handshake failing (a transfer-engine fault) is a peer failure
    like any other: under `recompute` the decode worker prefills the prompt itself."""
    from services.engine import SamplingParams
    from tests.workers.procs import start_worker
    from tests.workers.test_disaggregated import generate

    prefill = start_worker("prefill", model=model)
    decode = start_worker("decode", model=model, env={"PDSERVE_FAULT_FAIL_HANDSHAKES": "1"})
    try:
        prompt = colocated.tokenizer.encode("The capital of France is")
        ref = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
        tokens, last = generate(decode, prompt, prefill)
        assert tokens == ref[0].output.token_ids
        assert last.timings.prefill_fallback
        assert decode.load().prefill_fallbacks == 1
        tokens, last = generate(decode, prompt, prefill)  # the next handshake succeeds
        assert tokens == ref[0].output.token_ids and not last.timings.prefill_fallback
        decode.wait_all_blocks_free()
        prefill.wait_all_blocks_free()
    finally:
        decode.stop()
        prefill.stop()
