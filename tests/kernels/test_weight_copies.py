"""The CPU linears keep at most one extra weight copy (weight_copies.py): the tuner
gives up a faster candidate for a class rather than hold the weights three times."""

from __future__ import annotations

import time

from services.engine import SamplingParams
from services.kernels.cpu_backend import CpuOneDnnBackend, CpuSlabBackend
from services.kernels.shape_classes import KernelShapes
from services.kernels.tuner import TuningSizes, tune
from services.kernels.weight_copies import WEIGHT_COPIES, keep_one_weight_copy
from tests.engine.helpers import assert_all_blocks_free


def _times(**per_class):
    return {f"linear.{cls}": dict(times) for cls, times in per_class.items()}


def test_the_copy_that_loses_least_is_kept_and_the_others_fall_back():
    times = _times(
        decode1={"torch": 30.0, "cpu_slab": 20.0, "cpu_onednn": 25.0},  # slab 1.25x better
        decode8={"torch": 60.0, "cpu_slab": 50.0, "cpu_onednn": 26.0},  # onednn 1.92x
        prefill={"torch": 10.0, "cpu_slab": 11.0, "cpu_onednn": 12.0},
    )
    choices = {"linear.decode1": "cpu_slab", "linear.decode8": "cpu_onednn"}
    choices |= {"linear.prefill": "torch", "rms_norm.decode1": "cpu_native"}
    changed = keep_one_weight_copy(choices, times)
    assert changed == {"linear.decode1": "cpu_slab"}
    assert choices == {"linear.decode1": "cpu_onednn", "linear.decode8": "cpu_onednn",
                       "linear.prefill": "torch", "rms_norm.decode1": "cpu_native"}  # fmt: skip


def test_a_class_falls_back_to_the_reference_when_it_beats_the_kept_copy():
    times = _times(
        decode1={"torch": 30.0, "cpu_slab": 10.0, "cpu_onednn": 40.0},
        decode8={"torch": 30.0, "cpu_slab": 35.0, "cpu_onednn": 29.0},
    )
    choices = {"linear.decode1": "cpu_slab", "linear.decode8": "cpu_onednn"}
    assert keep_one_weight_copy(choices, times) == {"linear.decode8": "cpu_onednn"}
    assert choices == {"linear.decode1": "cpu_slab", "linear.decode8": "torch"}


def test_one_copying_candidate_or_none_is_left_alone():
    times = _times(decode1={"torch": 3.0, "cpu_slab": 2.0}, decode8={"torch": 1.0})
    choices = {"linear.decode1": "cpu_slab", "linear.decode8": "torch"}
    assert keep_one_weight_copy(choices, times) == {}
    assert choices == {"linear.decode1": "cpu_slab", "linear.decode8": "torch"}


class _SlowSlabs(CpuSlabBackend):
    """Column slabs made slow past one row (an injected delay): decode1's winner."""

    def linear(self, x, layer):
        if x.dim() == 2 and x.shape[0] > 1:
            time.sleep(0.004)
        return super().linear(x, layer)


class _SlowOneDnn(CpuOneDnnBackend):
    """oneDNN made slow at one row: every other class's winner."""

    def linear(self, x, layer):
        if x.dim() == 2 and x.shape[0] == 1:
            time.sleep(0.004)
        return super().linear(x, layer)


def test_the_tuner_keeps_one_copy_and_caches_the_change(tmp_path):
    shapes = KernelShapes(64, 4, 2, 16, 96, 16, "float32")
    candidates = {"cpu_slab": _SlowSlabs(), "cpu_onednn": _SlowOneDnn()}
    kwargs = dict(candidates=candidates, sizes=TuningSizes.tiny(), cache_dir=tmp_path)
    result = tune(shapes, "cpu", **kwargs)
    linears = {k: c for k, c in result.choices.items() if k.startswith("linear.")}
    assert set(linears.values()) == {"cpu_onednn"}, result.times_us
    assert result.one_copy == {"linear.decode1": "cpu_slab"}  # the free choice's
    times = result.times_us["linear.decode1"]
    assert times["cpu_slab"] < times["cpu_onednn"]
    assert "one weight copy: not cpu_slab" in result.table()
    cached = tune(shapes, "cpu", **kwargs)
    assert cached.from_cache and cached.choices == result.choices
    assert cached.one_copy == result.one_copy


def test_the_default_engine_holds_at_most_one_copy_of_each_linear(colocated):
    """The colocated engine on the default model after a request, as the tuner chose
    for this CPU: no linear keeps both copies, and no layer of one class another's."""
    colocated.generate(["The capital of France is"], SamplingParams(max_tokens=4))
    assert_all_blocks_free(colocated)
    model = colocated.engine.runner.model
    kinds = set()
    for module in model.modules():
        held = [name for name in WEIGHT_COPIES.values() if name in module.__dict__]
        assert len(held) <= 1, (type(module).__name__, held)
        kinds.update(held)
    assert len(kinds) <= 1, kinds
