"""CPU tuning: two candidates whose times are close are timed again in turns (a runoff)
and the choice follows it; a candidate far slower than the best so far is timed once.
Candidates here are the torch reference slowed by a set delay per linear call (an
injected condition), so which pairs are close is known. The delays pass on a virtual
clock that the timing code reads instead of the wall clock: a loaded CI host (other
processes preempting a timed call for milliseconds) cannot decide these cases."""

from __future__ import annotations

import pytest
import torch

from services.kernels.shape_classes import OP_CLASSES, KernelShapes
from services.kernels.timing import PAST_L2_BYTES, alternating_us, copies_past_l2
from services.kernels.torch_backend import TorchBackend
from services.kernels.tuner import TuningSizes, tune
from services.kernels.tuner_cases import run_case

SHAPES = KernelShapes(
    hidden_size=64,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    block_size=16,
    dtype="float32",
)
LINEAR_KEYS = [f"linear.{cls}" for cls in OP_CLASSES["linear"]]


class _VirtualClock:
    """Stands in for the `time` module in services/kernels/timing.py: time passes only
    when a candidate says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _VirtualClock:
    import services.kernels.timing as timing

    clock = _VirtualClock()
    monkeypatch.setattr(timing, "time", clock)
    return clock


class _Delayed(TorchBackend):
    """The reference, slowed by `delay_s` per linear call (on the virtual clock)."""

    def __init__(self, name: str, delay_s: float, clock: _VirtualClock | None = None):
        self.name, self.delay_s, self.clock = name, delay_s, clock
        self.calls = 0

    def linear(self, x, layer):
        self.calls += 1
        if self.clock is not None:
            self.clock.sleep(self.delay_s)
        return super().linear(x, layer)


def test_alternating_us_takes_turns_and_ranks_by_median(clock):
    order: list[str] = []

    def call(name, seconds):
        def run():
            order.append(name)
            clock.sleep(seconds)

        return run

    times = alternating_us({"a": call("a", 0.001), "b": call("b", 0.003)}, min_rounds=5)
    assert order[:2] == ["a", "b"]  # each once, untimed
    rounds = order[2:]
    assert len(rounds) >= 10 and len(rounds) % 2 == 0
    assert rounds[:6] == ["a", "b", "b", "a", "a", "b"]  # turns, the order flipping
    assert times == {"a": pytest.approx(1000), "b": pytest.approx(3000)}


def _tune_linear(tmp_path, monkeypatch, clock, delays: dict[str, float]):
    import services.kernels.shape_classes as shape_classes

    monkeypatch.setitem(shape_classes.CANDIDATES, "linear", tuple(delays))
    cands = {"torch": TorchBackend(), **{n: _Delayed(n, d, clock) for n, d in delays.items()}}
    result = tune(SHAPES, "cpu", candidates=cands, sizes=TuningSizes.tiny(), cache_dir=tmp_path)
    return result, cands


def test_close_candidates_get_a_runoff_whose_times_decide(tmp_path, monkeypatch, clock):
    result, _ = _tune_linear(tmp_path, monkeypatch, clock, {"a": 0.002, "b": 0.0021})
    for key in LINEAR_KEYS:
        assert sorted(result.runoffs[key]) == ["a", "b"], key
        times = result.times_us[key]
        assert result.choices[key] == min(times, key=times.get) == "a"  # 5% faster
    assert "(runoff)" in result.table()
    # the runoffs are kept with the choices
    again, _ = _tune_linear(tmp_path, monkeypatch, clock, {"a": 0.002, "b": 0.0021})
    assert again.from_cache and again.runoffs == result.runoffs


@pytest.mark.parametrize("delays", [{"a": 0.0002, "b": 0.003}, {"a": 0.003, "b": 0.0002}])
def test_far_apart_candidates_need_no_runoff(tmp_path, monkeypatch, clock, delays):
    result, cands = _tune_linear(tmp_path, monkeypatch, clock, delays)
    fast, slow = sorted(delays, key=delays.get)
    for key in LINEAR_KEYS:
        assert key not in result.runoffs
        assert result.choices[key] == fast
        assert result.times_us[key][slow] > 3 * result.times_us[key][fast]
    assert "(runoff)" not in result.table()
    # timed second, the slow candidate ran its check and one timed call per class; timed
    # first, it was sampled as usual
    per_case = {cls: _linear_calls_per_case(cls) for cls in OP_CLASSES["linear"]}
    if slow == "b":
        assert cands[slow].calls == 2 * sum(per_case.values())
    else:
        assert cands[slow].calls >= 5 * sum(per_case.values())


def _linear_calls_per_case(cls: str) -> int:
    counter = _Delayed("count", 0.0)
    cpu = torch.device("cpu")
    run_case("linear", cls, SHAPES, TuningSizes.tiny(), cpu, SHAPES.torch_dtype, counter)
    return counter.calls


def test_weight_copies_cycle_past_the_l2():
    qkv = 2 * 6144 * 4096  # Llama-3-8B's bf16 qkv weight, 50 MB: about one L2
    assert copies_past_l2(qkv) * qkv >= PAST_L2_BYTES > (copies_past_l2(qkv) - 1) * qkv
    assert copies_past_l2(PAST_L2_BYTES * 4) == 2  # two copies at least, to alternate
