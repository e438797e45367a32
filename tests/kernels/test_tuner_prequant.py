"""The kernel tuner's FP8 prequant pick (tuner_prequant.py) and the triton backend
honouring a tuned config's mode: every mode is timed on the engine's path (the norm
then the FP8 GEMV, through add_rms_norm_linear) and checked against mode "0"; a mode
that strays is left out; a mode wins only by MIN_GAIN; an explicit mode (argument or
PDSERVE_TRITON_FP8_PREQUANT) is never overridden. On a CPU under Triton's interpreter
(times mean nothing there: the mechanics are tested) and, marked gpu, the whole tuner
on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

from services.kernels.shape_classes import KernelShapes  # noqa: E402
from services.kernels.tuner import REL_TOL, config_label  # noqa: E402
from services.kernels.tuner_prequant import (  # noqa: E402
    MIN_GAIN,
    PREQUANT_MODES,
    pick_prequant,
    prequant_applies,
    prequant_times,
    tune_prequant,
)

ENV = "PDSERVE_TRITON_FP8_PREQUANT"
# block FP8 with 128 x 128 scales; qkv 256 rows, gate_up 384: whole tiles of both
SHAPES = KernelShapes(
    hidden_size=256, num_q_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=192,
    block_size=16, dtype="bfloat16", weight_quant="fp8_block_128x128",
)  # fmt: skip
TRITON_WINS = {"fp8_linear.decode1": "triton", "fused_add_rms_norm.decode1": "triton"}


def _triton(monkeypatch, **kwargs):
    from services.kernels.triton_backend import TritonBackend

    monkeypatch.delenv(ENV, raising=False)
    # the interpreter would fold every norm into its GEMV, which never reaches prequant
    return TritonBackend(norm_fold=False, **kwargs)


def _once(calls):  # each copy's call run once, timed (the interpreter's times mean nothing)
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6


def test_every_mode_is_timed_on_the_engines_path(device, monkeypatch, quant_calls):
    backend = _triton(monkeypatch)
    tol = REL_TOL[torch.bfloat16]
    times = prequant_times(SHAPES, device, backend, None, True, _once, tol, copies=1)
    assert set(times) == set(PREQUANT_MODES) and all(t > 0 for t in times.values())
    # checked once and timed once each: "gated" quantized before gate_up only, "1"
    # before qkv as well, "0" never
    assert quant_calls == {"plain": 2, "gated": 4}
    quant_calls.update(plain=0, gated=0)
    times = prequant_times(SHAPES, device, backend, None, False, _once, tol, copies=2)
    assert set(times) == set(PREQUANT_MODES)  # a MoE model: qkv only, two weight copies
    assert quant_calls == {"plain": 3, "gated": 0}  # "1": checked, then both copies


def test_a_mode_whose_output_strays_is_left_out(device, monkeypatch):
    from services.kernels.triton import norm_quant

    def broken(*args, **kwargs):  # a fault injected on purpose: the right shapes, zeros
        out, normed, res = real(*args, **kwargs)
        return torch.zeros_like(out), normed, res

    real = norm_quant.add_rms_norm_quant_fp8_gemv
    monkeypatch.setattr(norm_quant, "add_rms_norm_quant_fp8_gemv", broken)
    backend = _triton(monkeypatch)
    times = prequant_times(SHAPES, device, backend, None, True, _once, 3e-2, copies=1)
    assert set(times) == {"0"}
    assert pick_prequant(times) == "0"


def test_a_mode_wins_only_by_the_minimum_gain():
    assert MIN_GAIN > 0
    assert pick_prequant({"0": 100.0, "gated": 99.5, "1": 97.0}) == "1"
    assert pick_prequant({"0": 100.0, "gated": 98.0, "1": 99.0}) == "gated"
    assert pick_prequant({"0": 100.0, "gated": 100 * (1 - MIN_GAIN / 2), "1": 101.0}) == "0"
    assert pick_prequant({"0": 100.0, "gated": 120.0, "1": 130.0}) == "0"
    assert pick_prequant({"gated": 50.0}) == "0"  # nothing to beat: the default path
    assert pick_prequant({}) == "0"


def test_the_pick_applies_only_where_triton_runs_and_no_mode_is_set(monkeypatch):
    free = _triton(monkeypatch)
    assert free.fp8_prequant is None
    assert prequant_applies(TRITON_WINS, free)
    assert not prequant_applies({**TRITON_WINS, "fp8_linear.decode1": "scaled_mm"}, free)
    assert not prequant_applies({**TRITON_WINS, "fused_add_rms_norm.decode1": "aiter"}, free)
    assert not prequant_applies(TRITON_WINS, _triton(monkeypatch, fp8_prequant="0"))
    monkeypatch.setenv(ENV, "gated")
    from services.kernels.triton_backend import TritonBackend

    forced = TritonBackend()
    assert forced.fp8_prequant == "gated" and not prequant_applies(TRITON_WINS, forced)
    args = (TRITON_WINS, {"row_stages": 1}, SHAPES, "cpu", 3e-2)
    assert tune_prequant(*args, forced) is None  # the environment's mode holds
    assert tune_prequant(*args, None) is None  # no triton candidate loaded


def _norm_and_layer(device, n):
    from services.kernels.tuner_cases import random_fp8_layer

    gen = torch.Generator().manual_seed(7)
    h = SHAPES.hidden_size
    rows = [torch.randn(1, h, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
    norm_weight = torch.randn(h, generator=gen).to(device, torch.bfloat16)
    layer = random_fp8_layer(h, n, SHAPES.fp8_format(), gen, device)
    return (*rows, norm_weight, SHAPES.rms_norm_eps, layer)


def test_the_backend_runs_the_tuned_mode_unless_one_is_set(device, monkeypatch, quant_calls):
    backend = _triton(monkeypatch)
    args = _norm_and_layer(device, 256)
    plain = backend.add_rms_norm_linear(*args, config={"row_stages": 1})
    assert quant_calls == {"plain": 0, "gated": 0}  # no mode anywhere: "0"
    tuned = backend.add_rms_norm_linear(*args, config={"row_stages": 1, "prequant": "1"})
    assert quant_calls == {"plain": 1, "gated": 0}
    for got, want in zip(tuned, plain):
        if device == "cpu":  # the interpreter: bit for bit
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    backend.add_rms_norm_linear(*args, gated=True, config={"prequant": "gated"})
    assert quant_calls == {"plain": 1, "gated": 1}
    backend.add_rms_norm_linear(*args, config={"prequant": "gated"})  # not gated: plain norm
    assert quant_calls == {"plain": 1, "gated": 1}
    with pytest.raises(ValueError, match="prequant"):
        backend.add_rms_norm_linear(*args, config={"prequant": "yes"})
    for fixed in (_triton(monkeypatch, fp8_prequant="0"), _env_backend(monkeypatch, "0")):
        fixed.add_rms_norm_linear(*args, config={"prequant": "1"})  # the set mode wins
    assert quant_calls == {"plain": 1, "gated": 1}


def _env_backend(monkeypatch, mode):
    from services.kernels.triton_backend import TritonBackend

    monkeypatch.setenv(ENV, mode)
    return TritonBackend(norm_fold=False)


def test_the_tuned_mode_shows_in_the_table_label():
    assert config_label({"row_stages": 1, "prequant": "1"}) == "gemv s1 pq1"
    tile = {"row_stages": 1, "row_fold": [2048, 16, 4, 16], "prequant": "gated"}
    assert config_label(tile) == "gemv s1 k2048f16w4 n16 pqgated"
    assert config_label({"prequant": "0"}) == "gemv s1 pq0"  # the default depth


@pytest.mark.gpu
def test_the_gpu_tuner_picks_a_mode_and_caches_it(tmp_path, monkeypatch):
    from services.kernels.tuner import load_candidates, tune

    monkeypatch.delenv(ENV, raising=False)
    shapes = KernelShapes(
        hidden_size=2048, num_q_heads=16, num_kv_heads=4, head_dim=128,
        intermediate_size=5632, block_size=16, dtype="bfloat16",
        weight_quant="fp8_block_128x128", num_layers=4,
    )  # fmt: skip
    candidates = load_candidates(("torch", "triton"))
    result = tune(shapes, "cuda", candidates=candidates, cache_dir=tmp_path)
    assert prequant_applies(result.choices, candidates["triton"])  # triton beats torch here
    assert set(result.prequant_us) == set(PREQUANT_MODES)
    config = result.configs["fp8_linear.decode1"]
    assert config["prequant"] == pick_prequant(result.prequant_us)
    assert "pq" + config["prequant"] in result.table()
    cached = tune(shapes, "cuda", candidates=candidates, cache_dir=tmp_path)
    assert cached.from_cache and cached.configs == result.configs
    assert cached.prequant_us == result.prequant_us
