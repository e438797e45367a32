"""A remote prefill that fails while its KV write is still under way must not write
into the decode worker's blocks after the decode worker has moved on (recomputed, freed
and handed the blocks to another request).

The injected fault: every KV write on the prefill worker starts 7 s late and cannot be
called back once started (a slow link), while the decode worker's prefill deadline is
3 s. The prefill itself (connect, compute, start the write) must fit inside that
deadline: about 0.6 s on an idle 2-core machine, and a CI run once took over 1.5 s.
Real processes, the real Mooncake engine over TCP."""

from __future__ import annotations

import time

from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import BLOCK, expected, generate

WRITE_DELAY_S = 7.0
PREFILL_TIMEOUT_S = 3.0


def test_recompute_waits_until_the_late_write_cannot_land(model, colocated):
    prefill = start_worker(
        "prefill", model=model, env={"PDSERVE_FAULT_WRITE_DELAY_S": str(WRITE_DELAY_S)}
    )
    # 24 blocks: the second request must reuse blocks that the first one was given
    decode = start_worker(
        "decode",
        "--prefill-timeout",
        str(PREFILL_TIMEOUT_S),
        "--num-kv-blocks",
        "24",
        model=model,
    )
    try:
        first = [(i * 41) % 40000 + 100 for i in range(200)]  # 13 blocks
        second = [(i * 53) % 40000 + 7 for i in range(250)]  # 16 blocks and more
        assert -(-len(first) // BLOCK) + -(-(len(second) + 120) // BLOCK) > 24
        ref_first = expected(colocated, [first], max_tokens=8)[0]
        ref_second = expected(colocated, [second], max_tokens=120)[0]

        tokens, last = generate(decode, first, prefill, max_tokens=8)
        assert tokens == ref_first
        assert last.timings.prefill_fallback
        # The decode worker recomputed only once the prefill worker's write had ended:
        # by now it has landed (before the recompute) and nothing more can.
        report = prefill.load()
        assert any("delaying a write" in line for line in prefill.log), (
            f"the prefill worker never reached its KV write within {PREFILL_TIMEOUT_S} s"
        )
        assert report.kv_transfers_ok + report.kv_transfers_failed == 1, (
            "the decode worker answered while the prefill worker's write was still pending"
        )
        # The second request prefills locally into blocks the first one held; it decodes
        # long enough that an unstopped late write would land in the middle of it.
        tokens, last = generate(decode, second, None, max_tokens=120, ignore_eos=True)
        assert tokens == ref_second, "a late KV write corrupted a request that reused the blocks"
        assert prefill.wait_for_log("delaying a write", 1)
        for w in (prefill, decode):
            report = w.wait_all_blocks_free()
            assert report.num_free_blocks == report.num_total_blocks, w.role
    finally:
        prefill.stop()
        decode.stop()


def test_blocks_hold_the_right_kv_after_the_late_moment(model):
    """The same fault, with the decode side in this process so its KV bytes can be
    read: after the failed remote prefill, the blocks are given to a second request
    (prefilled here); once the prefill worker's delayed write has ended (the "late
    moment"), those blocks must hold exactly the second request's KV, as an independent
    engine computes it."""
    import asyncio
    import hashlib

    from pdpb.v1 import common_pb2
    from services.common.server import WorkerContext
    from services.common.settings import WorkerSettings
    from services.decode.remote_prefill import PrefillPeers, RemotePrefill
    from services.engine import EngineConfig, LLMEngine, SamplingParams

    prefill = start_worker(
        "prefill", model=model, env={"PDSERVE_FAULT_WRITE_DELAY_S": str(WRITE_DELAY_S)}
    )
    config = EngineConfig(model=model, role="decode", num_kv_blocks=24, max_model_len=384)
    ctx = WorkerContext(
        "decode", config, WorkerSettings(port=0, prefill_timeout_s=PREFILL_TIMEOUT_S)
    )
    ctx.load()
    ctx.ready.set()
    first = [(i * 41) % 40000 + 100 for i in range(200)]  # 13 blocks
    second = [(i * 53) % 40000 + 7 for i in range(20 * BLOCK)]  # 20 full blocks
    greedy = SamplingParams(temperature=0, max_tokens=1)

    def digest(engine, block_id):
        return hashlib.sha256(engine.runner.kv_cache[block_id].numpy().tobytes()).hexdigest()

    async def scenario():
        remote = RemotePrefill(ctx, PrefillPeers(ctx))
        engine, loop = ctx.engine, ctx.loop
        stream = loop.open_stream("first")
        timings = await remote.run(
            "first", first, greedy, common_pb2.SamplingParams(max_tokens=1), prefill.address, "t"
        )
        assert timings.prefill_fallback
        while not (await stream.get()).finished:
            pass
        loop.close_stream("first")
        # the second request takes the blocks back (24 in all: it must reuse the first's)
        stream = loop.open_stream("second")
        reservation = await loop.call(lambda: engine.reserve_remote_kv("second", second, greedy))
        await loop.call(lambda: engine.prefill_locally("second"))
        while not (await stream.get()).finished:
            pass
        loop.close_stream("second")
        await remote.peers.close()
        return reservation.block_ids

    try:
        block_ids = asyncio.run(scenario())
        # the late moment: the prefill worker's delayed write has ended
        deadline = time.monotonic() + 3 * WRITE_DELAY_S
        while prefill.load().kv_transfers_ok + prefill.load().kv_transfers_failed < 1:
            assert time.monotonic() < deadline, "the delayed write never ended"
            time.sleep(0.1)
        reference = LLMEngine(EngineConfig(model=model, num_kv_blocks=24, max_model_len=384))
        seq = reference.add_request("second", second, SamplingParams(temperature=0, max_tokens=2))
        reference.step()  # the whole prompt in one chunk, as the decode engine did
        assert seq.num_computed_tokens == len(second)
        got = [digest(ctx.engine, b) for b in block_ids]
        want = [digest(reference, b) for b in seq.block_table[: len(block_ids)]]
        assert got == want, "a late write changed blocks that another request now holds"
        assert ctx.engine.stats()["num_free_blocks"] == 24
    finally:
        ctx.close()
        prefill.stop()
