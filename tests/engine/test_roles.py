"""The prefill and decode roles, wired by hand inside one process: a prefill engine
computes the prompt's KV, its blocks are copied into the blocks a decode engine
reserved, and the decode engine continues. The result must equal the colocated
engine token for token, and both pools must end empty."""

from __future__ import annotations

import pytest

from services.engine import LLM, LLMEngine, SamplingParams
from services.engine.config import EngineConfig
from services.engine.sequence import SequenceStatus
from tests.engine.helpers import assert_all_blocks_free
from tests.engine.test_greedy_reference import TEXT_PROMPTS

PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=2)


@pytest.fixture(scope="module")
def engines(default_model_dir):
    model = str(default_model_dir)
    prefill = LLMEngine(EngineConfig(model=model, role="prefill", max_num_batched_tokens=64))
    decode = LLMEngine(EngineConfig(model=model, role="decode"))
    colocated = LLM(model)
    return prefill, decode, colocated


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt_ids, params):
    result, moved = _hand_over(prefill, decode, rid, prompt_ids, params)
    while not result.finished:
        for out in decode.step():
            if out.request_id == rid:
                result = out
    return result, moved


def _hand_over(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt_ids, params):
    """Prefill on one engine, copy the KV into the decode engine's reserved blocks and
    admit it there; returns admit_remote's output and how many blocks moved."""
    reservation = decode.reserve_remote_kv(rid, prompt_ids, params)
    prefill.add_request(rid, prompt_ids, params)
    first = None
    while first is None:
        for out in prefill.step():
            if out.request_id == rid:
                first = out
    seq = prefill.get_sequence(rid)
    assert seq.status == SequenceStatus.PREFILLED and first.finished
    # Only blocks the decode side does not already cache travel.
    skip = reservation.num_cached_tokens // decode.config.block_size
    src = seq.block_table[skip:]
    dst = reservation.block_ids[skip:]
    decode.runner.kv_cache[dst] = prefill.runner.kv_cache[src]
    prefill.release(rid)
    lp = first.output.logprobs[0] if first.output.logprobs else None
    token = first.output.token_ids[0]
    top = sorted(
        ((t, p.logprob) for t, p in (lp or {}).items() if t != token or p.rank == 1),
        key=lambda x: -x[1],
    )
    first_lp = (lp[token].logprob, lp[token].rank, top[:2]) if lp else None
    return decode.admit_remote(rid, token, first_lp), len(src)


def test_prefill_then_decode_equals_colocated(engines):
    prefill, decode, colocated = engines
    tok = colocated.tokenizer
    prompts = [tok.encode(p) for p in TEXT_PROMPTS]
    expected = colocated.generate(prompts, PARAMS)
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        out, _ = _disaggregated(prefill, decode, f"r{i}", prompt, PARAMS)
        assert out.output.token_ids == exp.output.token_ids
        assert out.output.text == exp.output.text
        for mine, ref in zip(out.output.logprobs, exp.output.logprobs):
            for t in ref:
                if t in mine:
                    assert abs(mine[t].logprob - ref[t].logprob) < 1e-4
    # Same long prompt again: the decode side now caches its prefix, fewer blocks move.
    again, moved = _disaggregated(prefill, decode, "again", prompts[-1], PARAMS)
    assert again.output.token_ids == expected[-1].output.token_ids
    assert moved == 1
    for engine in (prefill, decode, colocated):
        assert_all_blocks_free(engine)


def test_aborts_free_blocks_in_every_state(engines):
    prefill, decode, _ = engines
    prompt = list(range(100, 180))
    decode.reserve_remote_kv("awaiting", prompt, PARAMS)  # KV never arrives
    assert decode.abort_request("awaiting")
    prefill.add_request("mid-prefill", prompt, PARAMS)
    prefill.step()  # one 64-token chunk of 80: still running
    assert prefill.abort_request("mid-prefill")
    prefill.add_request("prefilled", prompt, PARAMS)
    while prefill.get_sequence("prefilled").status != SequenceStatus.PREFILLED:
        prefill.step()
    assert prefill.abort_request("prefilled")
    assert not prefill.abort_request("prefilled")
    with pytest.raises(ValueError, match="reservation"):
        decode.admit_remote("never-reserved", 5)
    for engine in (prefill, decode):
        assert_all_blocks_free(engine)


def test_async_decode_role_admits_while_decoding(engines, default_model_dir):
    """A decode worker's pattern with async scheduling: remote prefills arrive while
    other requests decode (each admit changes the batch) and the results still equal
    the colocated engine's."""
    prefill, _, colocated = engines
    decode = LLMEngine(
        EngineConfig(model=str(default_model_dir), role="decode", async_scheduling=True)
    )
    params = SamplingParams(temperature=0, max_tokens=20)
    prompts = [colocated.tokenizer.encode(p) for p in TEXT_PROMPTS[:5]]
    expected = [o.output.token_ids for o in colocated.generate(prompts, params)]
    finals, pending, step, ran_ahead = {}, list(enumerate(prompts)), 0, 0
    while pending or decode.has_unfinished_requests():
        if pending and step % 4 == 0:
            i, prompt = pending.pop(0)
            first, _ = _hand_over(prefill, decode, f"a{i}", prompt, params)
            if first.finished:
                finals[first.request_id] = first
        for out in decode.step():
            if out.finished:
                finals[out.request_id] = out
        ran_ahead += decode._in_flight is not None
        step += 1
    assert [finals[f"a{i}"].output.token_ids for i in range(len(prompts))] == expected
    assert ran_ahead > 5
    for engine in (prefill, decode):
        assert_all_blocks_free(engine)
