"""Async scheduling: a greedy decode step is launched before the previous step's
tokens reach the host. Whatever arrives, stops or is aborted meanwhile, the outputs
must equal the synchronous engine's, request by request, and every block must be free
again afterwards. On a CPU nothing overlaps, but the bookkeeping is the same."""

from __future__ import annotations

import pytest

from services.engine import LLM, LLMEngine, SamplingParams
from services.engine.config import EngineConfig
from tests.engine.helpers import assert_all_blocks_free

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the ocean:",
    "1, 2, 3, 4,",
    "List three colours:",
    "Once upon a time",
]


def _params(engine: LLMEngine) -> list[SamplingParams]:
    tok = engine.tokenizer
    comma = tok.encode(",")[-1]
    return [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=30, stop=["the"]),
        SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[comma]),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6),  # masks EOS: on the host
        SamplingParams(temperature=0.9, max_tokens=15, seed=5),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=18, logprobs=2),  # logprobs: on the host
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, max_tokens=22, seed=9),
    ]


def _run_script(engine: LLMEngine) -> tuple[dict, int]:
    """Requests arrive at different steps and one is aborted mid-decode; returns the
    final output per request and how many steps left a next step in flight."""
    params = _params(engine)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    # sampled on the device first (they run ahead), then requests that need the host
    # (min_tokens masking, logprobs) every step; unseeded sampling would draw from the
    # engine's shared generator, which wasted rows of stopped requests advance
    arrivals = {0: [0, 1, 5, 7], 3: [2, 4], 16: [3, 6]}
    abort = {"r1": 5}  # request -> step
    finals, pipelined, step = {}, 0, 0
    while step < 500:
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", prompts[i % len(prompts)], params[i])
        for rid, at in abort.items():
            if at == step:
                assert engine.abort_request(rid)
        for out in engine.step():
            assert out.request_id not in finals, "output after the request finished"
            if out.finished:
                finals[out.request_id] = out
        pipelined += engine._in_flight is not None
        step += 1
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
    return finals, pipelined


@pytest.fixture(scope="module")
def engines(default_model_dir):
    model = str(default_model_dir)
    sync = LLMEngine(EngineConfig(model=model, async_scheduling=False))
    pipelined = LLMEngine(EngineConfig(model=model, async_scheduling=True))
    return sync, pipelined


def test_config_default_follows_device():
    assert not EngineConfig(model="m").async_scheduling_enabled
    assert EngineConfig(model="m", device="cuda").async_scheduling_enabled
    assert not EngineConfig(
        model="m", device="cuda", async_scheduling=False
    ).async_scheduling_enabled
    with pytest.raises(ValueError, match="async_scheduling must be"):
        EngineConfig(model="m", async_scheduling="yes")


def test_async_equals_sync_with_arrivals_stops_and_abort(engines):
    sync, pipelined = engines
    expected, none_in_flight = _run_script(sync)
    got, in_flight = _run_script(pipelined)
    assert none_in_flight == 0
    assert in_flight > 8, "greedy decode steps never ran ahead"
    assert set(got) == set(expected) == {f"r{i}" for i in range(8)} - {"r1"}
    for rid, want in expected.items():
        out = got[rid].output
        assert out.token_ids == want.output.token_ids, rid
        assert out.text == want.output.text, rid
        assert (out.finish_reason, out.stop_reason) == (
            want.output.finish_reason,
            want.output.stop_reason,
        ), rid
        _assert_same_logprobs(out.logprobs, want.output.logprobs)
    reasons = {got[r].output.finish_reason for r in got}
    assert reasons == {"stop", "length"}
    for engine in engines:
        assert_all_blocks_free(engine)


def test_async_stops_at_max_model_len_and_under_preemption(default_model_dir):
    model = str(default_model_dir)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Write a short poem about the ocean:"]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        # 48 tokens of context at most, 5 blocks of 16 for three sequences: they hit
        # max_model_len mid-run and preempt each other
        llm = LLM(model, async_scheduling=async_scheduling, max_model_len=48, num_kv_blocks=5)
        outs = llm.generate(prompts, params)
        results.append([(o.output.token_ids, o.output.finish_reason) for o in outs])
        assert_all_blocks_free(llm)
        if async_scheduling:
            assert llm.engine.scheduler.num_preemptions > 0
    assert results[0] == results[1]
    assert all(reason == "length" for _, reason in results[1])
    assert all(len(ids) + len(p) >= 40 for (ids, _), p in zip(results[1], prompts))


def _assert_same_logprobs(got, want):
    # batches differ between the two runs, so the float sums do in the last bits
    if want is None:
        assert got is None
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for tid in w:
            assert g[tid].rank == w[tid].rank
            assert g[tid].logprob == pytest.approx(w[tid].logprob, abs=1e-4)


def test_prompts_arriving_during_decode_are_admitted_without_a_pipeline_stall(engines):
    """Steady arrivals: a prompt comes in every other step while greedy requests
    decode. Each is admitted next to the decode rows of a step launched before the
    previous step's tokens are read (its input tokens still on the device), so the
    pipeline never drains; a prompt needing logprobs takes a synchronous step. Every
    output equals the synchronous engine's and every block comes back."""
    sync, pipelined = engines
    tok = sync.tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) + [11 + i] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=10 + i % 5) for i in range(12)]
    params[7] = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    params[9] = SamplingParams(temperature=0.7, max_tokens=9, seed=3)
    results, in_flight = [], []
    for engine in engines:
        before = engine.num_pipelined_mixed_steps
        finals, step, ahead = {}, 0, 0
        while step < 400:
            if step % 2 == 0 and step // 2 < len(prompts):
                i = step // 2
                engine.add_request(f"a{i}", prompts[i], params[i])
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.output
            ahead += engine._in_flight is not None
            step += 1
            if step > 2 * len(prompts) and not engine.has_unfinished_requests():
                break
        results.append({r: (o.token_ids, o.text, o.finish_reason) for r, o in finals.items()})
        in_flight.append((engine.num_pipelined_mixed_steps - before, ahead))
        assert_all_blocks_free(engine)
    assert len(results[0]) == len(prompts)
    assert results[1] == results[0]
    assert in_flight[0] == (0, 0)
    mixed, ahead = in_flight[1]
    assert mixed >= 6, f"only {mixed} prompts were admitted into a pipelined step"
    assert ahead > 20


def test_device_sampling_decided_once_agrees_with_samples_on_device(engines):
    """The per-request threshold async scheduling reads every step gives what
    samples_on_device gives for every output length."""
    from services.engine.sampler import samples_on_device

    engine = engines[0]
    cases = {
        "greedy": SamplingParams(temperature=0),
        "min_tokens, EOS stops": SamplingParams(temperature=0, min_tokens=5),
        "min_tokens, nothing stops": SamplingParams(temperature=0, min_tokens=5, ignore_eos=True),
        "min_tokens, a stop id": SamplingParams(
            temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[7]
        ),
        "logprobs": SamplingParams(temperature=0, logprobs=2),
        "penalty": SamplingParams(temperature=0, repetition_penalty=1.2),
    }
    starts = {}
    for i, (name, params) in enumerate(cases.items()):
        seq = engine.add_request(f"dev-{i}", [1, 2, 3], params)
        req = engine.requests[seq.seq_id]
        starts[name] = req.device_sampling_from
        for n in range(8):
            seq.token_ids.append(9)  # n + 1 outputs
            for pending in (0, 1):
                want = samples_on_device(
                    params,
                    seq.num_output_tokens + pending,
                    bool(req.stop_token_ids),
                    bool(req.bad_word_seqs),
                )
                assert engine._sampled_on_device(seq, pending) == want, (name, n, pending)
        engine.abort_request(seq.seq_id)
    assert starts == {
        "greedy": 0,
        "min_tokens, EOS stops": 5,
        "min_tokens, nothing stops": 0,
        "min_tokens, a stop id": 3,
        "logprobs": None,
        "penalty": None,
    }
    assert_all_blocks_free(engine)


def test_a_full_batch_runs_ahead_while_requests_wait(default_model_dir):
    """At max_num_seqs with requests queued behind it, the running batch still
    pipelines (a queue at the limit is a saturated server's normal state): before,
    every such step waited for the one before it. Outputs equal the synchronous
    engine's and every block comes back."""
    model = str(default_model_dir)
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(
            EngineConfig(model=model, async_scheduling=async_scheduling, max_num_seqs=2)
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(f"q{i}", prompt, params)
        finals, ahead_while_waiting = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.output.token_ids
            if engine.scheduler.waiting and engine._in_flight is not None:
                ahead_while_waiting += 1
        results.append(finals)
        assert_all_blocks_free(engine)
        if async_scheduling:
            # the first two requests' 12 tokens, all but their first and last steps
            assert ahead_while_waiting >= 8, ahead_while_waiting
    assert results[0] == results[1]
    assert len(results[0]) == 4
