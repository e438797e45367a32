"""Priority scheduling (--scheduling-policy priority, vLLM's rule): waiting requests
run in (priority, arrival) order, lower first; when memory runs short the running
request last in that order gives its blocks back; outputs are the same tokens as
first-come-first-served; and an fcfs engine refuses a non-zero priority."""

from __future__ import annotations

import random

import pytest

from services.engine import LLMEngine, SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from tests.engine.helpers import assert_all_blocks_free, save_random_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("llama"), "llama"))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _params(priority: int, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def test_waiting_queue_is_in_priority_then_arrival_order():
    scheduler = Scheduler(BlockManager(64, 16), 8, 256, policy="priority")
    for name, priority in (("a", 3), ("b", 1), ("c", 3), ("d", -2), ("e", 1)):
        scheduler.add(Sequence(name, [5, 6], _params(priority)))
    assert [s.seq_id for s in scheduler.waiting] == ["d", "b", "e", "a", "c"]
    fcfs = Scheduler(BlockManager(64, 16), 8, 256)
    for name, priority in (("a", 3), ("b", 1)):
        fcfs.add(Sequence(name, [5, 6], _params(priority)))
    assert [s.seq_id for s in fcfs.waiting] == ["a", "b"]


def test_requests_finish_in_priority_order(model):
    engine = LLMEngine(
        EngineConfig(model=model, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=64)
    )
    for name, priority in (("low", 9), ("high", 0), ("mid", 4)):
        engine.add_request(name, _prompt(10, priority), _params(priority))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]
    assert_all_blocks_free(engine)


def test_memory_is_taken_from_the_lowest_priority(model):
    # 12 blocks of 16 tokens; two sequences growing to 100 tokens each cannot both fit
    prompts = {"urgent": (_prompt(40, 1), 0), "batch": (_prompt(40, 2), 7)}
    want = {}
    for name, (prompt, _) in prompts.items():
        alone = LLMEngine(EngineConfig(model=model, num_kv_blocks=64))
        alone.add_request(name, prompt, _params(0, 60))
        while alone.has_unfinished_requests():
            for out in alone.step():
                want[out.request_id] = out.outputs[0].token_ids
    engine = LLMEngine(EngineConfig(model=model, scheduling_policy="priority", num_kv_blocks=12))
    # the low-priority one arrives first: fcfs would preempt the newer, urgent one
    engine.add_request("batch", prompts["batch"][0], _params(7, 60))
    engine.add_request("urgent", prompts["urgent"][0], _params(0, 60))
    seqs = {name: engine.get_sequence(name) for name in prompts}
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
    assert seqs["batch"].num_preemptions > 0 and seqs["urgent"].num_preemptions == 0
    assert got == want  # recomputation changes nothing
    assert_all_blocks_free(engine)


def test_fcfs_refuses_a_priority(model):
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=16))
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        engine.add_request("r", [5, 6, 7], _params(1))
    engine.add_request("r", [5, 6, 7], _params(0))  # 0 is every fcfs request's priority
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model=model, scheduling_policy="lifo")
