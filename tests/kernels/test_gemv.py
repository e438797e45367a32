"""The decode GEMV (services/kernels/triton/gemv.py) against the fp32 torch reference on
fresh random inputs: odd sizes, bias, strided x and split-K on the CPU under Triton's
interpreter (small shapes, big blocks), Llama-3-8B projections on a GPU (marked gpu);
and the triton backend's linear, which takes it for up to 8 rows only."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.kernels.triton.gemv import GemvConfig, default_config, gemv  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import DTYPES, assert_close_rel  # noqa: E402

N, K = 200, 136  # neither a multiple of any block


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference(dtype, m, with_bias, device):
    x = _randn(m, K, dtype=dtype, device=device, seed=m)
    w = _randn(N, K, dtype=dtype, device=device, seed=10 + m, scale=K**-0.5)
    b = _randn(N, dtype=dtype, device=device, seed=20 + m) if with_bias else None
    out = gemv(x, w, b)
    assert out.shape == (m, N) and out.dtype == dtype
    assert_close_rel(out, _reference(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5])  # the FMA and the tensor-core path
@pytest.mark.parametrize(
    "config",
    [
        GemvConfig(block_n=4, block_k=32),  # many programs, K tail masked; 16 for m=5
        GemvConfig(block_n=64, block_k=16, num_warps=2, num_stages=2),
        GemvConfig(block_n=32, block_k=32, split_k=3),  # last split partly masked
        GemvConfig(block_n=256, block_k=16, split_k=16),  # more splits than tiles
        GemvConfig(block_n=8, block_k=64, k_fold=8),  # one row: 8 columns summed first
    ],
)
def test_gemv_configs_and_split_k(dtype, m, config, device):
    x = _randn(m, K, dtype=dtype, device=device, seed=30)
    w = _randn(N, K, dtype=dtype, device=device, seed=31, scale=K**-0.5)
    b = _randn(N, dtype=dtype, device=device, seed=32)
    assert_close_rel(gemv(x, w, b, config=config), _reference(x, w, b), dtype)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_even_k_without_bias(m, split_k, device):
    # K a multiple of BLOCK_K: the unmasked loop
    x = _randn(m, 128, dtype=torch.float16, device=device, seed=33)
    w = _randn(48, 128, dtype=torch.float16, device=device, seed=34, scale=128**-0.5)
    cfg = GemvConfig(block_n=16, block_k=32, split_k=split_k)
    assert_close_rel(gemv(x, w, config=cfg), _reference(x, w), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_strided_x(dtype, device):
    # a column slice (row stride > K) and a transposed view (K stride > 1)
    wide = _randn(4, 2 * K, dtype=dtype, device=device, seed=40)
    w = _randn(N, K, dtype=dtype, device=device, seed=41, scale=K**-0.5)
    for x in (wide[:, 7 : 7 + K], _randn(K, 3, dtype=dtype, device=device, seed=42).t()):
        assert not x.is_contiguous()
        assert_close_rel(gemv(x, w), _reference(x, w), dtype)


def test_gemv_rejects_bad_inputs(device):
    w = torch.zeros(N, K, device=device)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(torch.zeros(9, K, device=device), w)
    with pytest.raises(ValueError, match="K=135"):
        gemv(torch.zeros(2, K - 1, device=device), w)
    with pytest.raises(ValueError, match="row-major"):
        gemv(torch.zeros(2, N, device=device), w.t())
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(2, K, device=device, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv(torch.zeros(K, device=device), w)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(2, K, device=device), w, torch.zeros(N + 1, device=device))
    for bad in (
        dict(block_n=16, block_k=8),
        dict(block_n=48, block_k=64),
        dict(block_n=0, block_k=64),
        dict(block_n=16, block_k=64, num_warps=3),
        dict(block_n=16, block_k=64, num_stages=0),
        dict(block_n=16, block_k=64, split_k=0),
        dict(block_n=16, block_k=64, k_fold=3),
        dict(block_n=16, block_k=64, k_fold=128),
    ):
        with pytest.raises(ValueError):
            GemvConfig(**bad)


def test_gemv_empty_rows_and_k(device):
    w = torch.ones(N, K, device=device)
    assert gemv(torch.zeros(0, K, device=device), w).shape == (0, N)
    b = torch.arange(4.0, device=device)
    assert torch.equal(gemv(torch.zeros(2, 0, device=device), w[:4, :0], b), b.expand(2, 4))


def test_default_config():
    sms = 132  # H200: the sweep's picks for Llama-3-8B's projections
    picks = {
        (1, 6144, 4096): (4, 512, 2),
        (1, 4096, 4096): (8, 1024, 4),
        (1, 28672, 4096): (4, 512, 2),
        (1, 4096, 14336): (8, 1024, 4),
        (8, 6144, 4096): (64, 256, 4),
        (8, 4096, 4096): (32, 512, 4),
        (8, 28672, 4096): (128, 128, 4),
        (8, 4096, 14336): (32, 512, 4),
    }
    for (m, n, k), want in picks.items():
        cfg = default_config(n, k, sms, m)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps) == want and cfg.split_k == 1
    for m, narrowest in ((1, 1), (8, 16)):  # a small weight: narrowest rows, short K tiles
        cfg = default_config(512, 136, sms, m)
        assert cfg.block_n == narrowest and cfg.block_k == 256


# ---- the triton backend's linear -----------------------------------------------------


class _Linear(torch.nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_linear(dtype, device, monkeypatch):
    import services.kernels.triton as tk

    layer = _Linear(
        _randn(N, K, dtype=dtype, device=device, seed=50, scale=K**-0.5),
        _randn(N, dtype=dtype, device=device, seed=51),
    )
    calls = []
    monkeypatch.setattr(tk, "gemv", lambda *a, **kw: calls.append(kw) or gemv(*a, **kw))
    backend = TritonBackend()

    x1 = _randn(1, 1, K, dtype=dtype, device=device, seed=52)  # leading dims kept
    out = backend.linear(x1, layer)
    assert (
        out.shape == (1, 1, N)
        and out.dtype == dtype
        and calls == [{"row_stages": None, "row_fold": None}]
    )
    assert_close_rel(out, _reference(x1, layer.weight, layer.bias), dtype)
    # the tuner's K-loop depth for one row reaches the kernel; the same sums
    assert torch.equal(backend.linear(x1, layer, config={"row_stages": 3}), out)
    assert calls[-1] == {"row_stages": 3, "row_fold": None}
    # ...and its folded tile, as the tuner's JSON cache gives it back (a list)
    folded = backend.linear(x1, layer, config={"row_stages": 1, "row_fold": [64, 8, 2]})
    assert_close_rel(folded, out, dtype)
    assert calls[-1] == {"row_stages": 1, "row_fold": (64, 8, 2)}

    x16 = _randn(16, K, dtype=dtype, device=device, seed=53)  # past 8 rows: cuBLAS
    assert torch.equal(backend.linear(x16, layer), F.linear(x16, layer.weight, layer.bias))
    assert len(calls) == 3


def test_row_stages_deepen_one_rows_k_loop_only(device, monkeypatch):
    """gemv(row_stages=S): one row's launch takes S as its K-loop depth; more rows keep
    their tensor-core path's own stages."""
    import importlib

    gemv_mod = importlib.import_module("services.kernels.triton.gemv")  # not the function
    launched = []
    real = gemv_mod.launch
    monkeypatch.setattr(gemv_mod, "launch", lambda *a: launched.append(a[-1]) or real(*a))
    w = _randn(N, K, dtype=torch.float32, device=device, seed=54, scale=K**-0.5)
    for m in (1, 5):
        x = _randn(m, K, dtype=torch.float32, device=device, seed=55)
        assert torch.equal(gemv(x, w, row_stages=4), gemv(x, w))
        assert_close_rel(gemv(x, w, row_fold=(64, 8, 2)), gemv(x, w), torch.float32)
    one, five = launched[:4], launched[4:]
    assert one[0].num_stages == 4 and one[1].num_stages != 4  # one row
    assert (one[2].block_k, one[2].k_fold, one[2].num_warps) == (64, 8, 2)
    assert one[3].k_fold == 1
    assert five[0].num_stages == five[1].num_stages  # five rows: untouched
    assert five[2] == five[3]
    x = _randn(1, K, dtype=torch.float32, device=device, seed=56)
    assert_close_rel(gemv(x, w, row_fold=(64, 8, 2, 16)), gemv(x, w), torch.float32)
    assert launched[-2].block_n == 16  # the optional fourth: rows per program
    with pytest.raises(ValueError, match="row_fold is"):
        gemv(x, w, row_fold=(64, 8))


# ---- Llama-3-8B projections on a GPU -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_llama3_8b_shapes(n, k, m):
    dtype, dev = torch.bfloat16, "cuda"
    x = _randn(m, k, dtype=dtype, device=dev, seed=60)
    w = _randn(n, k, dtype=dtype, device=dev, seed=61, scale=k**-0.5)
    ref = _reference(x, w)
    assert_close_rel(gemv(x, w), ref, dtype)
    split = GemvConfig(block_n=32, block_k=256, split_k=4)
    assert_close_rel(gemv(x, w, config=split), ref, dtype)
