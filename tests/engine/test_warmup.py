"""The warm-up (services/engine/warmup.py) in process, on a small random Llama: each
role's plan runs and the engine is left exactly as it was (free blocks and their order,
prefix cache and its counters, the shared sampling generator)."""

from __future__ import annotations

import pytest

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.warmup import warm_up
from tests.engine.helpers import save_random_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("llama"), "llama"))


def _engine(model: str, role: str = "both") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, role=role, num_kv_blocks=64, block_size=16))


def _sample(engine: LLMEngine) -> list[int]:
    # unseeded: drawn from the engine's shared generator, which the warm-up must not touch
    engine.add_request("u", list(range(3, 40)), SamplingParams(temperature=1.0, max_tokens=6))
    out = []
    while engine.has_unfinished_requests():
        out = [o for o in engine.step() if o.finished] or out
    return out[0].output.token_ids


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_warmup_covers_the_role_and_leaves_no_state(llama_dir, role):
    engine = _engine(llama_dir, role)
    bm = engine.block_manager
    free_order, stats = list(bm.free_blocks), engine.stats()
    report = warm_up(engine)
    kinds = set(report.kinds())
    assert kinds == ({"prefill"} if role == "prefill" else {"prefill", "decode", "mixed"})
    assert report.role_path.startswith(f"{role}:")
    assert list(bm.free_blocks) == free_order
    assert engine.stats() == stats
    assert not bm.hash_to_block and not engine.requests
    with pytest.raises(RuntimeError, match="fresh engine"):  # only at start-up
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
        warm_up(engine)


def test_unseeded_sampling_unchanged_by_warmup(llama_dir):
    cold = _engine(llama_dir)
    warm = _engine(llama_dir)
    warm_up(warm)
    assert _sample(warm) == _sample(cold)
