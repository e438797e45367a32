"""The Triton fused MoE (services/kernels/triton/moe.py) against the torch backend's
fused_moe in fp32 on the same inputs: small shapes on the CPU under Triton's
interpreter (routing corner cases, tile configs, strided inputs, the alignment
buffers), Mixtral- and Qwen3-MoE-like shapes, no host syncs and CUDA-graph replay on a
GPU (marked gpu)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

import services.kernels.triton.moe_align as moe_align  # noqa: E402
from services.kernels.torch_backend import TorchBackend, select_experts  # noqa: E402
from services.kernels.triton.moe import fused_moe  # noqa: E402
from services.kernels.triton.moe_align import (  # noqa: E402
    align_plan,
    align_sizes,
    route_and_align,
)
from services.kernels.triton.moe_config import _check_config, default_config  # noqa: E402
from services.kernels.triton.moe_gemv import GEMV_MAX_PAIRS  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import DTYPES, assert_close_rel  # noqa: E402

REF = TorchBackend()
H, I = 32, 16  # noqa: E741
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
GEMV = {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 4}


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _moe_inputs(t, e, h=H, inter=I, *, dtype=torch.float32, device="cpu", seed=0):
    x = _randn(t, h, dtype=dtype, device=device, seed=seed)
    logits = _randn(t, e, dtype=torch.float32, device=device, seed=seed + 1)
    w13 = _randn(e, 2 * inter, h, dtype=dtype, device=device, seed=seed + 2, scale=h**-0.5)
    w2 = _randn(e, h, inter, dtype=dtype, device=device, seed=seed + 3, scale=inter**-0.5)
    return x, logits, w13, w2


def _reference(x, logits, w13, w2, top_k, renormalize):
    return REF.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), top_k, renormalize)


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("e,top_k", [(4, 1), (8, 2), (4, 4)])  # (4, 4): top_k == E
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_moe_matches_reference(t, e, top_k, renormalize, device):
    x, logits, w13, w2 = _moe_inputs(t, e, device=device, seed=t * 10 + e)
    out = fused_moe(x, logits, w13, w2, top_k, renormalize)
    assert out.shape == (t, H) and out.dtype == x.dtype
    assert_close_rel(out, _reference(x, logits, w13, w2, top_k, renormalize), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_dtypes(dtype, device):
    x, logits, w13, w2 = _moe_inputs(9, 8, dtype=dtype, device=device, seed=3)
    logits = logits.to(dtype)  # the router's own dtype: softmax still in fp32
    out = fused_moe(x, logits, w13, w2, 2, True)
    assert out.dtype == dtype
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, True), dtype)


@pytest.mark.parametrize(
    "config",
    [
        SMALL,  # several column blocks and K steps, GROUP_M swizzle
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=2, num_stages=1),
        dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    ],
)
def test_fused_moe_configs_and_tails(config, device):
    # H = 40, I = 24: neither a multiple of 16, so K and N tails are masked in both GEMMs
    x, logits, w13, w2 = _moe_inputs(11, 8, h=40, inter=24, device=device, seed=4)
    out = fused_moe(x, logits, w13, w2, 2, False, config=config)
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, False), torch.float32)


def test_fused_moe_skewed_routing(device):
    """Most experts receive no token while one receives every token (several tiles of
    one expert, the last partly padded); the second choice alternates between two."""
    t, e = 40, 8
    x, logits, w13, w2 = _moe_inputs(t, e, device=device, seed=5)
    logits = torch.full((t, e), -4.0, device=device)
    logits[:, 5] = 6.0
    logits[0::2, 2] = 2.0
    logits[1::2, 7] = 2.0
    for top_k in (1, 2):
        out = fused_moe(x, logits, w13, w2, top_k, False, config=SMALL)
        assert_close_rel(out, _reference(x, logits, w13, w2, top_k, False), torch.float32)


def test_fused_moe_strided_inputs(device):
    # x a column slice; w13 and w2 transposed views (stride 1 along their first dim)
    t, e = 6, 4
    wide = _randn(t, 2 * H, dtype=torch.float32, device=device, seed=6)
    x = wide[:, 3 : 3 + H]
    _, logits, w13, w2 = _moe_inputs(t, e, device=device, seed=7)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (x.is_contiguous() or w13_t.is_contiguous() or w2_t.is_contiguous())
    out = fused_moe(x, logits, w13_t, w2_t, 2, True, config=SMALL)
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, True), torch.float32)


def test_fused_moe_inputs_untouched_and_empty(device):
    x, logits, w13, w2 = _moe_inputs(5, 4, device=device, seed=8)
    before = [t.clone() for t in (x, logits, w13, w2)]
    fused_moe(x, logits, w13, w2, 2, True)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, logits, w13, w2)))
    assert fused_moe(x[:0], logits[:0], w13, w2, 2, True).shape == (0, H)


def test_triton_backend_fused_moe(device):
    x, logits, w13, w2 = _moe_inputs(7, 8, device=device, seed=9)
    out = TritonBackend().fused_moe(x, logits, w13, w2, 2, True)
    assert torch.equal(out, fused_moe(x, logits, w13, w2, 2, True))
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, True), torch.float32)


def test_fused_moe_rejects_bad_inputs(device):
    x, logits, w13, w2 = _moe_inputs(3, 4, device=device, seed=10)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, logits, w13, w2, 5, True)
    with pytest.raises(ValueError, match="disagree"):
        fused_moe(x, logits[:, :3], w13, w2, 2, True)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, logits, w13, w2[:, :, :-1], 2, True)
    with pytest.raises(ValueError, match="one dtype"):
        fused_moe(x, logits, w13.half(), w2, 2, True)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, logits, w13, w2, 2, True, config={**SMALL, "BLOCK_K": 8})
    with pytest.raises(ValueError, match="lacks"):
        fused_moe(x, logits, w13, w2, 2, True, config={"BLOCK_M": 16})


# ---- alignment -----------------------------------------------------------------------


def _expected_alignment(ids: torch.Tensor, e: int, block_m: int):
    """Python reference: each expert's pairs in token order, padded to block_m."""
    flat = ids.reshape(-1).tolist()
    rows, tiles = [], []
    for ex in range(e):
        pairs = [p for p, x in enumerate(flat) if x == ex]
        if pairs:
            n = -(-len(pairs) // block_m) * block_m
            rows += pairs + [len(flat)] * (n - len(pairs))
            tiles += [ex] * (n // block_m)
    return rows, tiles


def _small_chunks(t, e, top_k):
    """A plan of several chunks (three launches) and short loop steps: 3 tokens per
    chunk in routing steps of 2, scatter steps of 4 pairs."""
    chunk_t = 3
    return {**align_plan(t, e, top_k), "SUB_T": 2, "SUB_P": 4, "CHUNK_T": chunk_t,
            "num_chunks": -(-t // chunk_t)}  # fmt: skip


ALIGN_CASES = [
    (1, 4, 1, 16),
    (3, 8, 2, 16),
    (17, 4, 4, 16),
    (37, 8, 2, 32),
    (100, 128, 2, 16),  # in chunks of 3: more chunks (34) than one SUB_C step (32)
    (5, 128, 8, 16),
]


@pytest.mark.parametrize("chunks", ["default", "several"])
@pytest.mark.parametrize("t,e,top_k,block_m", ALIGN_CASES)
def test_route_and_align(t, e, top_k, block_m, chunks, device):
    rows, tiles = align_sizes(t * top_k, e, block_m)
    assert rows == tiles * block_m
    assert rows >= t * top_k + min(e, t * top_k) * (block_m - 1)
    plan = _small_chunks(t, e, top_k) if chunks == "several" else None
    if t <= 8:  # decode-sized: all in one program
        assert align_plan(t, e, top_k)["num_chunks"] == 1
    g = torch.Generator().manual_seed(t + e)
    routings = [
        torch.randn(t, e, generator=g),  # random
        torch.arange(e, dtype=torch.float32).expand(t, e).clone(),  # every token: same experts
        -torch.arange(e, dtype=torch.float32).expand(t, e).clone(),
        torch.randn(t, e, generator=g).half(),  # the router's dtype need not be fp32
    ]
    for renormalize, logits in zip([False, True, False, True], routings):
        logits = logits.to(device)
        weights, ids, sorted_ids, tile_expert, num_valid = route_and_align(
            logits, top_k, renormalize, block_m, torch.float32, plan
        )
        # the routing: select_experts' weights, each the probability of its expert
        # (equal logits, as fp16 ones may have, can order the experts differently)
        ids2, weights2 = ids.view(t, top_k).long(), weights.view(t, top_k)
        want_w, want_ids = select_experts(logits, top_k, renormalize)
        if logits.dtype == torch.float32:
            assert torch.equal(ids2, want_ids)
        assert (ids2.sort(dim=1).values[:, 1:] > ids2.sort(dim=1).values[:, :-1]).all()
        torch.testing.assert_close(weights2.sort(dim=1).values, want_w.sort(dim=1).values)
        probs = torch.softmax(logits.float(), dim=-1).gather(1, ids2)
        if renormalize:
            probs = probs / probs.sum(dim=1, keepdim=True)
        torch.testing.assert_close(weights2, probs)
        # shapes and dtypes from (T * top_k, E, BLOCK_M) only, whatever the routing
        assert sorted_ids.shape == (rows,) and tile_expert.shape == (tiles,)
        assert num_valid.shape == (1,)
        assert sorted_ids.dtype == tile_expert.dtype == num_valid.dtype == torch.int32
        want_rows, want_tiles = _expected_alignment(ids2.cpu(), e, block_m)
        n_valid = int(num_valid.item())
        assert n_valid == len(want_tiles)
        assert sorted_ids[: len(want_rows)].tolist() == want_rows
        assert (sorted_ids[len(want_rows) :] == t * top_k).all()  # the rest: padding
        assert tile_expert[:n_valid].tolist() == want_tiles
        assert ((tile_expert >= 0) & (tile_expert < e)).all()


def test_route_ties_and_infinite_logits(device):
    # equal logits: the lowest expert first; -inf logits are still chosen when needed
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, float("-inf"), 0.0, float("-inf")]])
    weights, ids, *_ = route_and_align(logits.to(device), 3, False, 16, torch.float32)
    assert ids.view(2, 3).tolist() == [[1, 2, 0], [0, 2, 1]]
    assert weights.view(2, 3)[1].tolist() == [0.5, 0.5, 0.0]


@pytest.mark.parametrize("t,e,top_k", [(9, 8, 2), (13, 4, 4)])
def test_fused_moe_several_chunks(t, e, top_k, device, monkeypatch):
    # the three-launch alignment path (prefill-sized batches) end to end
    monkeypatch.setattr(moe_align, "align_plan", _small_chunks)
    x, logits, w13, w2 = _moe_inputs(t, e, device=device, seed=11)
    out = fused_moe(x, logits, w13, w2, top_k, True, config=SMALL)
    assert_close_rel(out, _reference(x, logits, w13, w2, top_k, True), torch.float32)


@pytest.mark.parametrize("t,e,top_k", [(1, 128, 8), (64, 128, 8), (4096, 8, 2), (16, 8, 2)])
def test_candidate_configs(t, e, top_k):
    from services.kernels.triton.moe_config import _smem_bytes, candidate_configs

    configs = candidate_configs(t, e, 2048, 768, top_k, torch.bfloat16)
    assert configs[0] == default_config(t, e, 2048, 768, top_k, torch.bfloat16)
    gemv = [c for c in configs if c.get("kernel") == "gemv"]
    assert len(configs) - len(gemv) == 4
    assert len(gemv) == (3 if t * top_k <= 64 else 0)
    if gemv:  # one setting pipelines both K loops
        assert [(c.get("num_stages", 1), c.get("down_num_stages", 1)) for c in gemv] == [
            (1, 1), (1, 1), (3, 2)
        ]  # fmt: skip
    assert all(a != b for i, a in enumerate(configs) for b in configs[i + 1 :])
    for cfg in configs:
        assert _check_config(dict(cfg)) == cfg
        if cfg not in gemv:
            assert _smem_bytes(cfg, torch.bfloat16) <= 232448


@pytest.mark.parametrize("t,e,top_k", [(1, 4, 1), (3, 8, 2), (17, 4, 4), (6, 8, 2), (2, 160, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_gemv_path_matches_reference(t, e, top_k, renormalize, device):
    """The GEMV path (moe_gemv.py): ragged H and I (K and N tails), experts no token
    picks, every expert picked (top_k == E); routing by rank, and past 128 experts by
    repeated max passes."""
    x, logits, w13, w2 = _moe_inputs(t, e, 40, 24, device=device, seed=t + e)
    out = fused_moe(x, logits, w13, w2, top_k, renormalize, config=GEMV)
    assert out.shape == (t, 40) and out.dtype == x.dtype
    assert_close_rel(out, _reference(x, logits, w13, w2, top_k, renormalize), torch.float32)


def test_gemv_path_with_pipelined_k_loops(device):
    """Both GEMV kernels' K loops several tiles deep (the config's num_stages for
    gate/up, down_num_stages for down): the same sums."""
    x, logits, w13, w2 = _moe_inputs(3, 8, 72, 200, device=device, seed=11)  # 2 down tiles
    deep = {**GEMV, "num_stages": 3, "down_num_stages": 3}
    out = fused_moe(x, logits, w13, w2, 2, True, config=deep)
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, True), torch.float32)
    for key in ("num_stages", "down_num_stages"):
        with pytest.raises(ValueError, match=key):
            fused_moe(x, logits, w13, w2, 2, True, config={**GEMV, key: 0})


def test_gemv_path_with_folded_columns(device):
    """The gate/up kernel summing 8 adjacent columns before its partial tiles (k_fold),
    over a K tail: the same sums; a fold that is not a power of two <= BLOCK_K is refused."""
    x, logits, w13, w2 = _moe_inputs(3, 8, 72, 40, device=device, seed=12)
    folded = {**GEMV, "BLOCK_K": 64, "k_fold": 8}
    out = fused_moe(x, logits, w13, w2, 2, True, config=folded)
    assert_close_rel(out, _reference(x, logits, w13, w2, 2, True), torch.float32)
    for bad in (3, 128):
        with pytest.raises(ValueError, match="k_fold"):
            fused_moe(x, logits, w13, w2, 2, True, config={**folded, "k_fold": bad})


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_path_dtypes_and_strides(dtype, device):
    x, logits, w13, w2 = _moe_inputs(5, 8, dtype=dtype, device=device, seed=4)
    x_strided = torch.stack([x, x], dim=-1)[..., 0]  # x, inner stride 2
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)  # column-major experts
    out = fused_moe(x_strided, logits.to(dtype), w13, w2_t, 2, True, config=GEMV)
    assert_close_rel(out, _reference(x, logits.to(dtype), w13, w2, 2, True), dtype)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, logits, w13, w2, 2, True, config={**GEMV, "BLOCK_K": 8})
    with pytest.raises(ValueError, match="kernel"):
        fused_moe(x, logits, w13, w2, 2, True, config={**GEMV, "kernel": "other"})


def test_default_config():
    # decode-sized batches: 16-row tiles; big prefills: taller tiles
    assert default_config(1, 128, 2048, 768, 8, torch.bfloat16)["BLOCK_M"] == 16
    assert default_config(1, 8, 4096, 14336, 2, torch.bfloat16)["BLOCK_M"] == 16
    assert default_config(8192, 128, 2048, 768, 8, torch.bfloat16)["BLOCK_M"] >= 64
    assert default_config(8192, 8, 4096, 14336, 2, torch.bfloat16)["BLOCK_M"] >= 64
    for t in (1, 2, 16, 64, 256, 1024, 8192):
        for e, k in ((8, 2), (128, 8)):
            for dtype in DTYPES:
                _check_config(default_config(t, e, 1024, 512, k, dtype))


def test_default_launch_takes_the_gemv_path_for_one_token():
    """Without a tuned config one token runs the GEMV path (faster at both expert
    shapes on the H200), more tokens and FP8 experts the tiles."""
    from services.kernels.triton.moe_config import default_launch

    for e, k, h, i in ((128, 8, 2048, 768), (8, 2, 4096, 14336)):
        assert default_launch(1, e, h, i, k, torch.bfloat16)["kernel"] == "gemv"
        for t, dtype in ((2, torch.bfloat16), (64, torch.float32), (1, torch.float8_e4m3fn)):
            cfg = default_launch(t, e, h, i, k, dtype)
            assert cfg == default_config(t, e, h, i, k, dtype) and "kernel" not in cfg


# ---- GPU: Mixtral- and Qwen3-MoE-like shapes, no host syncs, CUDA graphs -------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "e,top_k,h,inter,renormalize",
    [(8, 2, 1024, 3584, True), (128, 8, 1024, 384, True), (128, 8, 512, 256, False)],
    ids=["mixtral", "qwen3_moe", "qwen3_moe_no_renorm"],
)
@pytest.mark.parametrize("t", [1, 7, 64, 1000])
@pytest.mark.parametrize("impl", ["triton", "aiter", "gemv"])
def test_fused_moe_gpu_bf16(e, top_k, h, inter, renormalize, t, impl):
    dtype = torch.bfloat16
    backend = _gpu_backend(impl)
    x, logits, w13, w2 = _moe_inputs(t, e, h, inter, dtype=dtype, device="cuda", seed=t)
    logits = logits.to(dtype)
    backend.fused_moe(x, logits, w13, w2, top_k, renormalize)  # compile (that may sync)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        out = backend.fused_moe(x, logits, w13, w2, top_k, renormalize)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_rel(out, _reference(x, logits, w13, w2, top_k, renormalize), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("e,top_k", [(8, 2), (128, 8)], ids=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("impl", ["triton", "aiter", "gemv"])
def test_fused_moe_cuda_graph_replay(e, top_k, t, impl):
    """Captured once, replayed with other inputs and routing: equal to eager."""
    dtype, h, inter = torch.bfloat16, 256, 128
    backend = _gpu_backend(impl)
    x, logits, w13, w2 = _moe_inputs(t, e, h, inter, dtype=dtype, device="cuda", seed=20)
    static_x, static_logits = x.clone(), logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.fused_moe(static_x, static_logits, w13, w2, top_k, True)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.fused_moe(static_x, static_logits, w13, w2, top_k, True)
    for seed in (21, 22):
        new_x, new_logits, _, _ = _moe_inputs(t, e, h, inter, dtype=dtype, device="cuda", seed=seed)
        if seed == 22:  # every token to the same experts: one expert group of T rows
            new_logits = torch.arange(e, device="cuda", dtype=torch.float32).expand(t, e)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        eager = backend.fused_moe(new_x, new_logits, w13, w2, top_k, True)
        assert torch.equal(out, eager)
        assert_close_rel(out, _reference(new_x, new_logits, w13, w2, top_k, True), dtype)


class _GemvPath(TritonBackend):
    """pdserve's Triton backend with the GEMV config the tuner may pick."""

    def fused_moe(self, *args, config=None):
        return super().fused_moe(*args, config=config or dict(GEMV))


def _gpu_backend(impl: str):
    if impl == "triton":
        return TritonBackend()
    if impl == "gemv":
        return _GemvPath()
    from services.kernels import get_backend

    try:
        return get_backend("aiter")
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "aiter"])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_every_tuner_config_is_correct(impl, t):
    """The launch settings the tuner may pick on this GPU (Qwen3-30B-A3B experts) all
    compute the same MoE."""
    from services.kernels.triton.moe_config import candidate_configs

    e, top_k, h, inter, dtype = 128, 8, 2048, 768, torch.bfloat16
    backend = _gpu_backend(impl)
    x, logits, w13, w2 = _moe_inputs(t, e, h, inter, dtype=dtype, device="cuda", seed=7)
    want = _reference(x, logits, w13, w2, top_k, True)
    configs = candidate_configs(t, e, h, inter, top_k, dtype)
    tiles = [cfg for cfg in configs if cfg.get("kernel") != "gemv"]
    gemv = [cfg for cfg in configs if cfg.get("kernel") == "gemv"]
    assert len(tiles) == 4
    assert len(gemv) == (3 if t * top_k <= GEMV_MAX_PAIRS else 0)
    # aiter's kernel takes tile configs only; the GEMV path is pdserve's own
    for cfg in tiles + (gemv if impl == "triton" else []):
        out = backend.fused_moe(x, logits, w13, w2, top_k, True, config=cfg)
        assert_close_rel(out, want, dtype)
