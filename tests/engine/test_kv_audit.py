"""Leak accounting (issue 18): the engine's audit finds no orphaned KV block through
normal work (shared prefix-cache blocks included), counts exactly the blocks of a
request the engine was made to forget (a fault injected on purpose), and reports the
age of the oldest reservation on both roles until it ends."""

from __future__ import annotations

import random

import pytest

from services.engine import LLMEngine, SamplingParams
from services.engine.config import EngineConfig
from services.engine.kv_audit import audit_kv
from services.engine.sequence import SequenceStatus
from tests.engine.helpers import assert_all_blocks_free, save_random_model

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("llama"), "llama"))


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        assert audit_kv(engine).orphaned_blocks == 0  # mid-flight too


def test_no_orphans_through_normal_work_and_shared_prefixes(model):
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, max_num_batched_tokens=32))
    shared = _prompt(40)
    for i, prompt in enumerate([shared + [5], shared + [6, 7], _prompt(70, 1), _prompt(3, 2)]):
        engine.add_request(str(i), prompt, PARAMS)
    _run(engine)
    assert engine.block_manager.prefix_hits > 0  # blocks really were shared
    assert audit_kv(engine).orphaned_blocks == 0
    assert_all_blocks_free(engine)


def test_a_forgotten_request_is_counted(model):
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64))
    engine.add_request("kept", _prompt(20), PARAMS)
    engine.add_request("lost", _prompt(50, 3), PARAMS)
    engine.step()  # both prefilled: blocks allocated
    lost = engine.get_sequence("lost")
    held = len(lost.block_table)
    # the fault: the engine forgets the request without freeing its blocks
    del engine.requests["lost"]
    engine.scheduler.running.remove(lost)
    assert audit_kv(engine).orphaned_blocks == held > 0
    outs = [out for _ in range(20) for out in engine.step()]  # the kept one finishes
    assert any(o.finished for o in outs) and audit_kv(engine).orphaned_blocks == held
    engine.block_manager.free(lost)  # give them back: the audit is clean again
    assert audit_kv(engine).orphaned_blocks == 0


def test_oldest_reservation_on_both_roles(model):
    decode = LLMEngine(EngineConfig(model=model, role="decode", num_kv_blocks=64))
    decode.reserve_remote_kv("r", _prompt(30), PARAMS)
    seq = decode.get_sequence("r")
    assert seq.status == SequenceStatus.AWAITING_KV
    assert audit_kv(decode, now=seq.reserved_at + 7.5).oldest_reservation_s == 7.5
    assert audit_kv(decode).orphaned_blocks == 0
    decode.abort_request("r")
    assert audit_kv(decode).oldest_reservation_s == 0.0

    prefill = LLMEngine(EngineConfig(model=model, role="prefill", num_kv_blocks=64))
    prefill.add_request("p", _prompt(30), PARAMS)
    while prefill.get_sequence("p").status != SequenceStatus.PREFILLED:
        prefill.step()
    seq = prefill.get_sequence("p")
    assert audit_kv(prefill, now=seq.reserved_at + 2.0).oldest_reservation_s == 2.0
    prefill.release("p")  # the KV was sent: no reservation left
    assert audit_kv(prefill).oldest_reservation_s == 0.0
    assert_all_blocks_free(prefill)
