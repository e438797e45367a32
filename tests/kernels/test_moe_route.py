"""The router GEMV that routes in its last program (moe_route.py) against the linear
followed by moe_gemv's routing, and the Triton backend's fused_moe given the router."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.kernels.torch_backend import TorchBackend, select_experts  # noqa: E402
from tests.kernels.helpers import assert_close_rel  # noqa: E402

H, I = 64, 16  # noqa: E741
GEMV = {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 4}
TILED = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _gate(e, dtype, device, seed):
    gate = torch.nn.Linear(H, e, bias=False).to(device)
    gate.weight.data = _randn(e, H, dtype=dtype, device=device, seed=seed, scale=H**-0.5)
    return gate


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("e,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_route_equals_the_linear_then_the_routing(t, e, top_k, renormalize, dtype, device):
    from services.kernels.triton.moe_gemv import _route
    from services.kernels.triton.moe_route import gate_route

    x = _randn(t, H, dtype=dtype, device=device, seed=t)
    gate = _gate(e, dtype, device, seed=e)
    workspace = {}
    weights, ids, logits = gate_route(x, gate.weight, top_k, renormalize, workspace)
    # the logits are the linear's, rounded to x's dtype
    assert logits.dtype == dtype
    assert_close_rel(logits, torch.nn.functional.linear(x.float(), gate.weight.float()), dtype)
    # the routing is moe_gemv's routing of those logits, value for value
    want_w, want_ids = _route(logits, dtype, t, e, top_k, renormalize, False)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    # and the reference's top-k of them (bf16 logits tie often, and torch.topk breaks
    # ties its own way: the chosen logits agree, slot for slot)
    ref_w, ref_ids = select_experts(logits.float(), top_k, renormalize)
    chosen = logits.gather(1, ids.view(t, top_k).long())
    assert torch.equal(chosen, logits.gather(1, ref_ids.long()))
    assert_close_rel(weights.view(t, top_k).float(), ref_w.float(), dtype)
    # every launch leaves its arrival counters zero, so the next one routes the same
    assert int(workspace["gate_route_counters"].abs().sum()) == 0
    again = gate_route(x, gate.weight, top_k, renormalize, workspace)
    assert torch.equal(again[1], ids) and torch.equal(again[0], weights)


def test_equal_logits_rank_the_lower_expert_first(device):
    """Duplicate router rows give bit-equal logits: the tie goes to the lower index, as
    the routing from logits (and the repeated-max top-k) breaks it."""
    from services.kernels.triton.moe_route import gate_route

    gate = _gate(8, torch.float32, device, seed=3)
    gate.weight.data[5] = gate.weight.data[2]
    gate.weight.data[7] = gate.weight.data[2]
    x = _randn(2, H, dtype=torch.float32, device=device, seed=4)
    x[0] = gate.weight.data[2]  # experts 2, 5 and 7 lead token 0, tied
    weights, ids, logits = gate_route(x, gate.weight, 3, False, {})
    assert ids.view(2, 3)[0].tolist() == [2, 5, 7]
    assert logits[0, 2] == logits[0, 5] == logits[0, 7]
    assert torch.equal(weights.view(2, 3)[0], weights.view(2, 3)[0, :1].expand(3))


@pytest.mark.parametrize("config", [GEMV, TILED, None])
def test_backend_fused_moe_given_the_router_equals_it_given_the_logits(config, device):
    """On the GEMV path the router's GEMV routes (no logits pass between kernels); on the
    tiled path the backend runs the router as a linear first, and the output is the one
    its logits give, bit for bit. The fused GEMV sums in its own order: the same experts,
    weights within rounding."""
    from services.kernels.triton_backend import TritonBackend

    t, e, top_k = 3, 8, 2
    x = _randn(t, H, dtype=torch.float32, device=device, seed=5)
    gate = _gate(e, torch.float32, device, seed=6)
    w13 = _randn(e, 2 * I, H, dtype=torch.float32, device=device, seed=7, scale=H**-0.5)
    w2 = _randn(e, H, I, dtype=torch.float32, device=device, seed=8, scale=I**-0.5)
    backend = TritonBackend(moe_route_in_gemv=True)
    kwargs = {} if config is None else {"config": config}
    out = backend.fused_moe(x, None, w13, w2, top_k, True, gate=gate, **kwargs)
    logits = backend.linear(x, gate)
    from_logits = backend.fused_moe(x, logits, w13, w2, top_k, True, **kwargs)
    routed = "gate_route_counters" in backend._moe_workspace
    assert routed == (config is GEMV)  # by default 3 tokens take the tiles
    if routed:
        assert_close_rel(out, from_logits, torch.float32)
    else:
        assert torch.equal(out, from_logits)
    ref = TorchBackend().fused_moe(x, None, w13, w2, top_k, True, gate=gate)
    assert_close_rel(out, ref, torch.float32)
    one = TritonBackend(
        moe_route_in_gemv=True
    )  # one token: the default is the GEMV path, routed by the router
    one.fused_moe(x[:1], None, w13, w2, top_k, True, gate=gate, **kwargs)
    assert ("gate_route_counters" in one._moe_workspace) == (config is not TILED)
    assert backend.fused_moe(x[:0], None, w13, w2, top_k, True, gate=gate).shape == (0, H)


def test_routing_and_logits_together_are_refused(device):
    from services.kernels.triton.moe import fused_moe

    x = _randn(2, H, dtype=torch.float32, device=device, seed=1)
    w13 = _randn(4, 2 * I, H, dtype=torch.float32, device=device, seed=2)
    w2 = _randn(4, H, I, dtype=torch.float32, device=device, seed=3)
    logits = _randn(2, 4, dtype=torch.float32, device=device, seed=4)
    routing = (torch.ones(4, device=device), torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="routing without router_logits"):
        fused_moe(x, logits, w13, w2, 2, True, config=GEMV, routing=routing)
    with pytest.raises(ValueError, match="routing without router_logits"):
        fused_moe(x, None, w13, w2, 2, True, config=TILED, routing=routing)
    with pytest.raises(ValueError, match="needs router_logits"):
        fused_moe(x, None, w13, w2, 2, True, config=GEMV)


def test_engine_decoding_one_sequence_routes_in_the_router_gemv(tmp_path, device, monkeypatch):
    """A random Qwen3-MoE through the engine on the triton backend with
    PDSERVE_TRITON_MOE_ROUTE=gemv, one sequence at a time: its decode steps take the GEMV
    path, where the router's GEMV routes. Tokens and logprobs equal the torch
    reference's; blocks return."""
    from services.engine import LLM, SamplingParams
    from services.kernels.triton.moe_route import MOE_ROUTE_ENV
    from tests.engine.helpers import assert_all_blocks_free, save_random_moe_model

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(MOE_ROUTE_ENV, "gemv")
    path = str(save_random_moe_model(tmp_path / "m", "qwen3_moe"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, kernel_backend=backend, device=device, max_num_seqs=1)
        outs[backend] = llm.generate([[5, 9, 200, 31]], params)[0].output
        assert_all_blocks_free(llm)
        if backend == "triton":
            assert "gate_route_counters" in llm.engine.runner.ops._moe_workspace
    assert outs["triton"].token_ids == outs["torch"].token_ids
    for a, b, token in zip(
        outs["triton"].logprobs, outs["torch"].logprobs, outs["torch"].token_ids
    ):
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_the_router_gemv_routes_only_when_switched_on(monkeypatch, device):
    from services.kernels.triton.moe_route import MOE_ROUTE_ENV
    from services.kernels.triton_backend import TritonBackend

    x = _randn(1, H, dtype=torch.float32, device=device, seed=1)
    gate = _gate(4, torch.float32, device, seed=2)
    w13 = _randn(4, 2 * I, H, dtype=torch.float32, device=device, seed=3)
    w2 = _randn(4, H, I, dtype=torch.float32, device=device, seed=4)
    for value, routed in ((None, False), ("separate", False), ("gemv", True)):
        if value is None:
            monkeypatch.delenv(MOE_ROUTE_ENV, raising=False)
        else:
            monkeypatch.setenv(MOE_ROUTE_ENV, value)
        backend = TritonBackend()
        backend.fused_moe(x, None, w13, w2, 2, True, config=GEMV, gate=gate)
        assert ("gate_route_counters" in backend._moe_workspace) == routed
    monkeypatch.setenv(MOE_ROUTE_ENV, "on")
    with pytest.raises(ValueError, match=MOE_ROUTE_ENV):
        TritonBackend().fused_moe(x, None, w13, w2, 2, True, config=GEMV, gate=gate)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_qwen3_router_routes_the_same_launch_after_launch_and_in_a_graph(t):
    """Qwen3-30B-A3B's router (128 experts x 2048, top 8) in bf16: 64 programs race to
    the counter; every launch and every graph replay gives the routing of its own
    logits, and leaves the counters zero."""
    from services.kernels.triton.moe_gemv import _route
    from services.kernels.triton.moe_route import gate_route

    x = _randn(t, 2048, dtype=torch.bfloat16, device="cuda", seed=t)
    w = _randn(128, 2048, dtype=torch.bfloat16, device="cuda", seed=9, scale=2048**-0.5)
    workspace = {}
    first = gate_route(x, w, 8, True, workspace)
    assert_close_rel(first[2], torch.nn.functional.linear(x.float(), w.float()), torch.bfloat16)
    want = _route(first[2], torch.bfloat16, t, 128, 8, True, False)
    for _ in range(20):
        weights, ids, _ = gate_route(x, w, 8, True, workspace)
        assert torch.equal(ids, want[1]) and torch.equal(weights, want[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gate_route(x, w, 8, True, workspace)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[1], want[1]) and torch.equal(captured[0], want[0])
        assert int(workspace["gate_route_counters"].abs().sum()) == 0


@pytest.mark.parametrize("switch", ["gemv", "separate"])
def test_tuned_backend_lets_a_triton_pick_route_in_its_router_gemv(switch, monkeypatch, device):
    """The tuned backend hands the router to a triton fused_moe pick that routes in its
    GEMV (switched on); otherwise it runs the router as a linear on the linear's pick."""
    from services.kernels.shape_classes import KernelShapes, all_keys
    from services.kernels.triton.moe_route import MOE_ROUTE_ENV
    from services.kernels.triton_backend import TritonBackend
    from services.kernels.tuned_backend import TunedBackend

    monkeypatch.setenv(MOE_ROUTE_ENV, switch)
    shapes = KernelShapes(
        hidden_size=H, num_q_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
        block_size=16, dtype="float32", num_experts=4, top_k=2, moe_intermediate_size=I,
    )  # fmt: skip
    choices = dict.fromkeys(all_keys(shapes), "torch")
    choices["fused_moe.decode1"] = "triton"
    triton_backend = TritonBackend()
    tuned = TunedBackend(
        {"torch": TorchBackend(), "triton": triton_backend},
        choices,
        shapes,
        {"fused_moe.decode1": GEMV},
    )
    x = _randn(1, H, dtype=torch.float32, device=device, seed=1)
    gate = _gate(4, torch.float32, device, seed=2)
    w13 = _randn(4, 2 * I, H, dtype=torch.float32, device=device, seed=3)
    w2 = _randn(4, H, I, dtype=torch.float32, device=device, seed=4)
    out = tuned.fused_moe(x, None, w13, w2, 2, True, gate=gate)
    assert ("gate_route_counters" in triton_backend._moe_workspace) == (switch == "gemv")
    ref = TorchBackend().fused_moe(x, None, w13, w2, 2, True, gate=gate)
    assert_close_rel(out, ref, torch.float32)
