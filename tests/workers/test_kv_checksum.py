"""The KV bytes that arrive on the decode side equal the prefill side's KV, block for
block: real engines (prefill and decode roles) and the real Mooncake engine over TCP,
in one process so both caches can be read."""

from __future__ import annotations

import hashlib

from kvtransfer import create_connector
from services.common.kv import register_kv_cache
from services.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import assert_all_blocks_free


def _connector(engine: LLMEngine):
    conn = create_connector("mooncake", hostname="127.0.0.1", protocol="tcp")
    register_kv_cache(conn, engine.runner.kv_cache, engine.runner.kv_spec)
    return conn


def _digest(engine: LLMEngine, block_id: int) -> str:
    return hashlib.sha256(engine.runner.kv_cache[block_id].numpy().tobytes()).hexdigest()


def test_transferred_blocks_are_byte_identical(default_model_dir):
    model = str(default_model_dir)
    prefill = LLMEngine(EngineConfig(model=model, role="prefill", num_kv_blocks=64))
    decode = LLMEngine(
        EngineConfig(model=model, role="decode", num_kv_blocks=16, max_model_len=256)
    )
    p_conn, d_conn = _connector(prefill), _connector(decode)
    try:
        p_conn.add_peer(d_conn.agent_info())
        params = SamplingParams(temperature=0, max_tokens=4)
        prompt = [(i * 13) % 40000 + 50 for i in range(150)]  # 10 blocks
        # Fragment the decode pool so the destination blocks form several runs.
        for i in range(5):
            decode.reserve_remote_kv(f"filler{i}", list(range(100 * i + 1, 100 * i + 49)), params)
        for i in (0, 2, 4):
            decode.abort_request(f"filler{i}")
        reservation = decode.reserve_remote_kv("r", prompt, params)
        prefill.add_request("r", prompt, params)
        while not prefill.step():
            pass
        src = prefill.get_sequence("r").block_table
        dst = reservation.block_ids
        before = [_digest(decode, b) for b in range(16)]
        stats = p_conn.write_blocks(d_conn.agent_info(), src, dst, timeout_s=30)
        assert stats.num_blocks == len(src) == 10
        for s, d in zip(src, dst):
            assert _digest(decode, d) == _digest(prefill, s)
        untouched = set(range(16)) - set(dst)
        assert all(_digest(decode, b) == before[b] for b in untouched)
        assert stats.num_regions > 2  # scattered destination, coalesced where possible
        prefill.release("r")
        for rid in ("r", "filler1", "filler3"):
            decode.abort_request(rid)
        assert_all_blocks_free(prefill)
        assert_all_blocks_free(decode)
    finally:
        p_conn.close()
        d_conn.close()
