"""Programmatic dependent launch (PDL) on a Hopper GPU: the Triton kernels start
before the kernel ahead of them has finished and wait only where they read its
results (services/kernels/triton/_launch.py). A kernel that read too early would see
the previous step's activations; these tests run the same requests with PDL off and on,
in CUDA graphs and eagerly, and need the same tokens and logprobs (the arithmetic is
the same, only the launch differs)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, save_random_model, save_random_moe_model
from tests.engine.test_fp8_checkpoints import block_fp8  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

# The kernel modules are imported inside the tests: importing them here, while pytest
# collects, would define every @triton.jit kernel before tests/kernels/conftest.py sets
# TRITON_INTERPRET on a CPU machine.
PDL_ENV = "PDSERVE_TRITON_PDL"


@pytest.fixture(autouse=True)
def _hopper():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9+")


def _requests():
    rng = random.Random(7)
    # one prompt alone (batch-1 decode graphs) and 19 together (mixed steps, bigger graphs)
    single = [[rng.randrange(3, 512) for _ in range(37)]]
    many = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 300))] for _ in range(19)]
    return single, many


def _run(model_dir, monkeypatch, pdl: bool, eager: bool, **engine_args):
    from services.kernels.triton import _launch

    assert _launch.PDL_ENV == PDL_ENV
    monkeypatch.setenv(PDL_ENV, "1" if pdl else "0")
    assert _launch.use_pdl(torch.empty(1, device="cuda")) == pdl
    llm = LLM(
        str(model_dir),
        device="cuda",
        kernel_backend="triton",
        enforce_eager=eager,
        cuda_graph_max_batch=32,
        **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = [llm.generate(prompts, params) for prompts in _requests()]
    assert_all_blocks_free(llm)
    return [o.output for batch in outs for o in batch]


def _assert_same(off, on):
    assert len(off) == len(on)
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) <= 1e-5, (t, x[t], y[t])


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_pdl_equals_plain_launches(kind, eager, tmp_path, monkeypatch):
    model_dir = save_random_model(tmp_path / kind, kind)
    off = _run(model_dir, monkeypatch, False, eager, dtype="float32")
    on = _run(model_dir, monkeypatch, True, eager, dtype="float32")
    _assert_same(off, on)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_pdl_equals_plain_launches_moe(kind, tmp_path, monkeypatch):
    model_dir = save_random_moe_model(tmp_path / kind, kind)
    off = _run(model_dir, monkeypatch, False, False, dtype="float32")
    on = _run(model_dir, monkeypatch, True, False, dtype="float32")
    _assert_same(off, on)


def test_pdl_equals_plain_launches_fp8(block_fp8, monkeypatch):  # noqa: F811
    qdir = block_fp8[0]
    off = _run(qdir, monkeypatch, False, False, dtype="bfloat16")
    on = _run(qdir, monkeypatch, True, False, dtype="bfloat16")
    _assert_same(off, on)


def test_pdl_moe_gemv_in_a_graph_equals_plain(monkeypatch):
    """The decode-only MoE GEMV kernels (route, gate/up, down: only a tuned choice runs
    them in the engine) replayed in a CUDA graph, with PDL off and on."""
    from services.kernels.triton.moe import fused_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, inter, top_k = 16, 512, 384, 4
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(e, h, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    cfg = {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4}
    x0 = torch.randn(3, h, device="cuda", generator=g, dtype=torch.bfloat16)
    logits0 = torch.randn(3, e, device="cuda", generator=g, dtype=torch.float32)
    results = {}
    for pdl in (False, True):
        monkeypatch.setenv(PDL_ENV, "1" if pdl else "0")
        x, logits = x0.clone(), logits0.clone()
        fused_moe(x, logits, w13, w2, top_k, True, config=cfg)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, logits, w13, w2, top_k, True, config=cfg)
        outs = []
        for step in range(5):  # new inputs each replay: stale reads would show
            x.copy_(x0 * (step + 1))
            logits.copy_(logits0.roll(step, dims=1))
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        results[pdl] = torch.stack(outs)
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)
    eager = fused_moe(x0 * 5, logits0.roll(4, dims=1), w13, w2, top_k, True, config=cfg)
    torch.testing.assert_close(results[True][-1], eager, rtol=0, atol=0)
