"""Scenario a: every 7th KV write of the prefill worker fails
(PDSERVE_FAULT_FAIL_EVERY_NTH_WRITE=7), under concurrent streaming load through the
router. With the decode worker's policy `recompute` every answer is still the colocated
engine's; with `fail` the requests whose write failed get a clean OpenAI error (not a
hang) and the rest are right. Either way both sides end with every KV block free and
none orphaned."""

from __future__ import annotations

import asyncio

from tests.chaos.stack import (
    Stack,
    assert_blocks_back,
    assert_openai_error,
    count_log,
    note,
    prompts,
    references,
    run_streams,
)

EVERY = 7
STREAMS = 28  # four failed writes per phase
MAX_TOKENS = 12
FIRED = "WARNING kvtransfer.faults: fault injection: failing KV write"


def test_every_7th_write_fails_under_recompute_and_fail(model, colocated):
    texts = prompts(STREAMS, "a")
    refs = references(colocated, texts, MAX_TOKENS)
    fail_texts = prompts(STREAMS, "af")
    fail_refs = references(colocated, fail_texts, MAX_TOKENS)
    stack = Stack(
        model,
        prefill=[{"env": {"PDSERVE_FAULT_FAIL_EVERY_NTH_WRITE": str(EVERY)}}],
        decode=[{"args": ("--prefill-failure-policy", "recompute")}],
    )
    with stack:
        (prefill,), (decode,) = stack.prefills, stack.decodes
        # --- recompute: every answer right, each failed write recomputed by the decode side
        outcomes = asyncio.run(run_streams(stack.router.url, texts, MAX_TOKENS))
        assert [o.kind for o in outcomes] == ["ok"] * STREAMS, [o.detail for o in outcomes]
        assert [o.text for o in outcomes] == refs
        fired = count_log(prefill, FIRED)
        assert fired == STREAMS // EVERY
        p, d = prefill.load(), decode.load()
        assert (p.kv_transfers_ok, p.kv_transfers_failed) == (STREAMS - fired, fired)
        assert d.prefill_fallbacks == fired
        assert_blocks_back(stack.workers)

        # --- fail: the same prefill worker (its count goes on) with a decode worker of
        # policy `fail`, behind a router of their own
        failing = stack.add_worker("decode", "--prefill-failure-policy", "fail")
        router = stack.start_router(prefills=[prefill], decodes=[failing])
        router.wait_ready(pairs=1)
        outcomes = asyncio.run(run_streams(router.url, fail_texts, MAX_TOKENS))
        fired_now = count_log(prefill, FIRED) - fired
        assert fired_now == STREAMS // EVERY
        failed = [o for o in outcomes if o.kind != "ok"]
        assert len(failed) == fired_now, [(o.kind, o.detail) for o in outcomes]
        note(
            f"policy fail: {len(failed)} of {STREAMS} refused, e.g. HTTP {failed[0].status}:",
            failed[0].error,
        )
        for o in failed:
            # refused before the first token: a real HTTP status with OpenAI's error body
            assert (o.kind, o.status) == ("http_error", 503), (o.kind, o.status, o.detail)
            assert_openai_error(o.error)
            assert "prefill" in o.error["message"], o.error
        for o, ref in zip(outcomes, fail_refs):
            if o.kind == "ok":
                assert o.text == ref
        assert failing.load().prefill_fallbacks == fired_now
        assert_blocks_back(stack.workers)
