"""The triton backend's elementwise kernels against the torch reference (fp32 on the
same inputs) on fresh random inputs: small sizes run on the CPU under Triton's
interpreter, Llama-3-8B sizes on a GPU (marked gpu)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from services.models.rope import cos_sin_cache  # noqa: E402
from tests.kernels.helpers import DTYPES, assert_close_rel  # noqa: E402

REF = TorchBackend()
TRI = TritonBackend()
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _randn(*shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _fused_qkv(tokens, hq, hk, d, dtype, device, seed):
    """q, k, v as the model makes them: strided views of one fused projection."""
    qkv = _randn(tokens, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=seed)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (13, 200)])
def test_rms_norm(dtype, shape, device):
    x = _randn(*shape, dtype=dtype, device=device, seed=1) * 3
    w = _randn(shape[-1], dtype=dtype, device=device, seed=2)
    out = TRI.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_rel(out, REF.rms_norm(x.float(), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype, device):
    # Qwen3's q/k norm: [T, H, D] views of the fused qkv output, normalised per head
    q, k, _ = _fused_qkv(9, 6, 2, 32, dtype, device, seed=3)
    w = _randn(32, dtype=dtype, device=device, seed=4)
    for x in (q, k):
        assert not x.is_contiguous()
        out = TRI.rms_norm(x, w, 1e-6)
        assert_close_rel(out, REF.rms_norm(x.float(), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, device):
    x = _randn(11, 96, dtype=dtype, device=device, seed=5)
    res = _randn(11, 96, dtype=dtype, device=device, seed=6) * 4
    w = _randn(96, dtype=dtype, device=device, seed=7)
    x_before, res_before = x.clone(), res.clone()
    out, res_out = TRI.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = REF.fused_add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
    assert out.dtype == dtype and res_out.dtype == dtype
    assert_close_rel(res_out, ref_res, dtype)
    assert_close_rel(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 16), (6, 3, 24), (4, 4, 64)])
def test_rotary_embedding(dtype, heads, device):
    hq, hk, d = heads
    q, k, _ = _fused_qkv(10, hq, hk, d, dtype, device, seed=8)
    table = cos_sin_cache(d, 300, LLAMA3_ROPE).to(device)
    g = torch.Generator().manual_seed(9)
    positions = torch.randint(0, 300, (10,), generator=g).to(device)
    q_out, k_out = TRI.rotary_embedding(positions, q, k, table)
    q_ref, k_ref = REF.rotary_embedding(positions, q.float(), k.float(), table)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    assert_close_rel(q_out, q_ref, dtype)
    assert_close_rel(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 48), (2, 3, 2 * 20)])
def test_silu_and_mul(dtype, shape, device):
    x = _randn(*shape, dtype=dtype, device=device, seed=10) * 2
    out = TRI.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close_rel(out, REF.silu_and_mul(x.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 1])
def test_store_kv_cache_strided(dtype, block_size, device):
    layers, hk, d, tokens = 3, 2, 16, 12
    num_blocks = 9 if block_size > 1 else 20
    kv = _randn(num_blocks, layers, 2, block_size, hk, d, dtype=dtype, device=device, seed=11)
    expected = kv.clone()
    _, k, v = _fused_qkv(tokens, 4, hk, d, dtype, device, seed=12)
    k = k.contiguous()  # rotary's output; v stays a strided slice of qkv
    g = torch.Generator().manual_seed(13)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(device)
    TRI.store_kv_cache(k, v, kv[:, 1, 0], kv[:, 1, 1], slots)
    REF.store_kv_cache(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(kv, expected)  # a copy: bit exact, other layers untouched


def test_store_kv_cache_skips_negative_slots(device):
    kv = torch.zeros(4, 1, 2, 4, 1, 16, device=device)
    k = torch.ones(3, 1, 16, device=device)
    slots = torch.tensor([5, -1, 2], device=device)
    TRI.store_kv_cache(k, 2 * k, kv[:, 0, 0], kv[:, 0, 1], slots)
    assert kv[:, 0, 0].sum().item() == 32 and kv[:, 0, 1].sum().item() == 64
    assert kv[1, 0, 0, 1].sum().item() == 16 and kv[0, 0, 0, 2].sum().item() == 16


# ---- Llama-3-8B sizes on a GPU -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_llama3_8b_sizes(dtype):
    dev, tokens = "cuda", 1024
    x = _randn(tokens, 4096, dtype=dtype, device=dev, seed=20)
    res = _randn(tokens, 4096, dtype=dtype, device=dev, seed=21)
    w = _randn(4096, dtype=dtype, device=dev, seed=22)
    assert_close_rel(TRI.rms_norm(x, w, 1e-5), REF.rms_norm(x.float(), w.float(), 1e-5), dtype)
    out, r = TRI.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_r = REF.fused_add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
    assert_close_rel(out, ref_out, dtype)
    assert_close_rel(r, ref_r, dtype)

    q, k, v = _fused_qkv(tokens, 32, 8, 128, dtype, dev, seed=23)
    table = cos_sin_cache(128, 8192, LLAMA3_ROPE).to(dev)
    positions = torch.randint(0, 8192, (tokens,), device=dev)
    q_out, k_out = TRI.rotary_embedding(positions, q, k, table)
    q_ref, k_ref = REF.rotary_embedding(positions, q.float(), k.float(), table)
    assert_close_rel(q_out, q_ref, dtype)
    assert_close_rel(k_out, k_ref, dtype)

    gu = _randn(tokens, 2 * 14336, dtype=dtype, device=dev, seed=24)
    assert_close_rel(TRI.silu_and_mul(gu), REF.silu_and_mul(gu.float()), dtype)

    kv = torch.zeros(2048, 4, 2, 16, 8, 128, dtype=dtype, device=dev)
    expected = kv.clone()
    slots = torch.randperm(2048 * 16, device=dev)[:tokens]
    TRI.store_kv_cache(k_out, v, kv[:, 2, 0], kv[:, 2, 1], slots)
    REF.store_kv_cache(k_out, v, expected[:, 2, 0], expected[:, 2, 1], slots)
    assert torch.equal(kv, expected)


def test_programmatic_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL is a CUDA launch attribute for compute capability 9+: never on a CPU tensor
    (the interpreter), and off everywhere when PDSERVE_TRITON_PDL=0. Hopper runs are in
    tests/engine/test_gpu_pdl.py."""
    from services.kernels.triton import _launch

    monkeypatch.delenv(_launch.PDL_ENV, raising=False)
    assert not _launch.use_pdl(torch.zeros(1))
    if torch.cuda.is_available():
        monkeypatch.setenv(_launch.PDL_ENV, "0")
        assert not _launch.use_pdl(torch.zeros(1, device="cuda"))
        monkeypatch.setenv(_launch.PDL_ENV, "1")
        expected = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
        assert _launch.use_pdl(torch.zeros(1, device="cuda")) == expected


def test_an_ab_switch_takes_its_values_and_refuses_others(monkeypatch):
    from services.kernels.triton._launch import PDL_ENV, env_switch

    monkeypatch.delenv(PDL_ENV, raising=False)
    assert env_switch(PDL_ENV, "1", ("0", "1")) == "1"
    monkeypatch.setenv(PDL_ENV, "0")
    assert env_switch(PDL_ENV, "1", ("0", "1")) == "0"
    monkeypatch.setenv(PDL_ENV, "off")  # read as "on" before: only "0" turned PDL off
    with pytest.raises(ValueError, match=f"{PDL_ENV}='off'"):
        env_switch(PDL_ENV, "1", ("0", "1"))
