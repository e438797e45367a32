"""A remote prefill that fails while its KV write is still under way must not write
into the decode worker's blocks after the decode worker has moved on (recomputed, freed
and handed the blocks to another request).

The injected fault: every KV write on the prefill worker starts 4 s late and cannot be
called back once started (a slow link), while the decode worker's prefill deadline is
1.5 s. Real processes, the real Mooncake engine over TCP."""

from __future__ import annotations

from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import BLOCK, expected, generate

WRITE_DELAY_S = 4.0


def test_recompute_waits_until_the_late_write_cannot_land(default_model_dir, colocated_llm):
    model = str(default_model_dir)
    prefill = start_worker(
        "prefill", model=model, env={"PDSERVE_FAULT_WRITE_DELAY_S": str(WRITE_DELAY_S)}
    )
    # 24 blocks: the second request must reuse blocks that the first one was given
    decode = start_worker(
        "decode", "--prefill-timeout", "1.5", "--num-kv-blocks", "24", model=model
    )
    try:
        first = [(i * 41) % 40000 + 100 for i in range(200)]  # 13 blocks
        second = [(i * 53) % 40000 + 7 for i in range(250)]  # 16 blocks and more
        assert -(-len(first) // BLOCK) + -(-(len(second) + 120) // BLOCK) > 24
        ref_first = expected(colocated_llm, [first], max_tokens=8)[0]
        ref_second = expected(colocated_llm, [second], max_tokens=120)[0]

        tokens, last = generate(decode, first, prefill, max_tokens=8)
        assert tokens == ref_first
        assert last.timings.prefill_fallback
        # The decode worker recomputed only once the prefill worker's write had ended:
        # by now it has landed (before the recompute) and nothing more can.
        report = prefill.load()
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
