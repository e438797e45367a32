"""The aiter backend: the three shims that load AITER's Triton kernels outside ROCm
(unit tests that need no aiter), and the mapped ops against the torch reference when
amd-aiter is installed (CPU under Triton's interpreter, or a GPU)."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels import aiter_shims, get_backend  # noqa: E402
from tests.kernels.helpers import (  # noqa: E402
    assert_close_rel,
    make_attention_batch,
    reference_attention,
)

# ---- shims without aiter -------------------------------------------------------------


class _FakeKernel:
    """Stands in for a JITFunction: records the kwargs its run() receives."""

    def __init__(self, fn=None):
        self.fn = fn
        self.seen = None

    def run(self, *args, grid, warmup, **kwargs):
        self.seen = kwargs
        return "ran"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


def test_drop_amd_launch_options_filters_kwargs_down_the_chain():
    inner = _FakeKernel()
    outer = _FakeKernel(fn=inner)  # like an Autotuner wrapping a JITFunction
    aiter_shims.drop_amd_launch_options(outer)
    aiter_shims.drop_amd_launch_options(outer)  # idempotent
    assert outer[(1,)](1, 2, num_warps=4, waves_per_eu=2, kpack=2, matrix_instr_nonkdim=16)
    assert outer.seen == {"num_warps": 4}
    inner.run(grid=(1,), warmup=False, waves_per_eu=1, BLOCK=16)
    assert inner.seen == {"BLOCK": 16}


def test_version_pin_warns_on_mismatch():
    assert aiter_shims.AITER_CHECKED_VERSION == "0.1.7.post2.dev18"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert aiter_shims.check_version(aiter_shims.AITER_CHECKED_VERSION)
    with pytest.warns(RuntimeWarning, match="checked with 0.1.7.post2.dev18"):
        assert not aiter_shims.check_version("0.1.6")


def test_version_check_names_a_missing_aiter_instead_of_version_none(monkeypatch):
    # not installed: the backend refuses with the install hint, not "amd-aiter None"
    monkeypatch.setattr(aiter_shims, "installed_version", lambda: None)
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    with pytest.raises(aiter_shims.AiterUnavailable, match="is not installed"):
        aiter_shims.check_version()
    # imported without package metadata (a source tree on the path): the version is unknown
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    with pytest.warns(RuntimeWarning, match="version is unknown"):
        assert not aiter_shims.check_version()


def test_get_backend_aiter_unavailable_is_a_clear_value_error(monkeypatch):
    def unavailable(op):
        raise aiter_shims.AiterUnavailable("amd-aiter is not installed (pip install amd-aiter)")

    monkeypatch.setattr(aiter_shims, "load_triton_op", unavailable)
    with pytest.raises(ValueError, match="kernel backend 'aiter' is unavailable"):
        get_backend("aiter")


def test_get_backend_names():
    assert get_backend("torch").name == "torch"
    assert get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="known: torch, triton, aiter"):
        get_backend("cuda")


# ---- with amd-aiter installed --------------------------------------------------------

needs_aiter = pytest.mark.skipif(
    aiter_shims.installed_version() is None and "aiter" not in sys.modules,
    reason="amd-aiter is not installed (pip install amd-aiter)",
)


@pytest.fixture(scope="module")
def aiter_backend():
    try:
        return get_backend("aiter")
    except ValueError as exc:
        pytest.skip(str(exc))


@needs_aiter
def test_shims_load_kernels_without_rocm_init(aiter_backend):
    if aiter_shims.is_rocm():
        pytest.skip("ROCm: the real `import aiter` is used, no shims")
    root = sys.modules["aiter"]
    assert getattr(root, aiter_shims._SHIMMED_FLAG, False)  # bare package (shim 1)
    assert not hasattr(root, "getLogger")  # aiter/__init__.py never ran
    from aiter.ops.triton.utils._triton import arch_info

    assert arch_info.get_arch() == aiter_shims.arch_string() == "gfx942"  # shim 2
    from aiter.ops.triton._triton_kernels.unified_attention import kernel_unified_attention_2d

    assert getattr(kernel_unified_attention_2d.run, aiter_shims._SHIMMED_FLAG, False)  # shim 3


@needs_aiter
def test_arch_override(monkeypatch, aiter_backend):
    if aiter_shims.is_rocm():
        pytest.skip("ROCm: get_arch is aiter's own")
    from aiter.ops.triton.utils._triton import arch_info

    monkeypatch.setenv("PDSERVE_AITER_ARCH", "gfx950")
    assert arch_info.get_arch() == "gfx950"


def _aiter_dtypes(device):
    # Triton's CPU interpreter stores bf16 as uint16 and its tl.dot and bf16 + bf16 work
    # on the raw bits (an interpreter limitation; our own kernels upcast first), and
    # aiter's kernels do both: bf16 runs on GPUs only.
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@needs_aiter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aiter_norms_and_rope(dtype, aiter_backend, device):
    if dtype not in _aiter_dtypes(device):
        pytest.skip("bf16 arithmetic is wrong in Triton's CPU interpreter; GPU only")
    from services.kernels.torch_backend import TorchBackend
    from services.models.rope import cos_sin_cache

    ref = TorchBackend()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 96, generator=g).to(dtype).to(device)
    res = torch.randn(9, 96, generator=g).to(dtype).to(device)
    w = torch.randn(96, generator=g).to(dtype).to(device)
    assert_close_rel(
        aiter_backend.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6), dtype
    )
    out, r = aiter_backend.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_r = ref.fused_add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    assert_close_rel(out, ref_out, dtype)
    assert_close_rel(r, ref_r, dtype)

    qkv = torch.randn(7, 8 * 16 + 2 * 2 * 16, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([128, 32, 32], dim=-1)
    q, k = q.view(7, 8, 16), k.view(7, 2, 16)
    table = cos_sin_cache(16, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(device)
    pos = torch.randint(0, 64, (7,), generator=g).to(device)
    q_out, k_out = aiter_backend.rotary_embedding(pos, q, k, table)
    q_ref, k_ref = ref.rotary_embedding(pos, q.float(), k.float(), table)
    assert_close_rel(q_out, q_ref, dtype)
    assert_close_rel(k_out, k_ref, dtype)


@needs_aiter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # aiter's padded rows divide by 0
def test_aiter_unified_attention_on_strided_block_major_cache(aiter_backend, device):
    # unified_attention addresses K/V through all four strides: a layer's strided view
    # of the block-major cache works as is (no copy), mixed decode + chunked prefill.
    for dtype in _aiter_dtypes(device):
        q, k_cache, v_cache, meta, _ = make_attention_batch(
            [1, 1, 37, 5, 1],
            [40, 3, 20, 0, 70],
            block_size=16,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=32,
            dtype=dtype,
            device=device,
        )
        # fp32 on a GPU: aiter's dots would be tf32, so the fallback's exact kernel runs
        tf32 = dtype == torch.float32 and device == "cuda"
        assert aiter_backend.supports_attention(q, k_cache) != tf32
        before = aiter_backend.fallbacks["paged_attention.fp32"]
        out = aiter_backend.paged_attention(q, k_cache, v_cache, meta, scale=0.2)
        assert aiter_backend.fallbacks["paged_attention.fp32"] == before + tf32
        assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.2), dtype)


@needs_aiter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # aiter's padded rows divide by 0
@pytest.mark.parametrize("window", [5, 16, 33])
def test_aiter_sliding_window(window, aiter_backend, device):
    # window_size (window - 1, 0): keys q - window < k <= q, as the reference; and the
    # fallback (block size 1) gets the window too
    dtype = torch.float16
    for block_size in (16, 1):
        q, k_cache, v_cache, meta, _ = make_attention_batch(
            [1, 1, 37, 5, 1], [40, 3, 20, 0, 70], block_size=block_size, num_q_heads=8,
            num_kv_heads=2, head_dim=32, dtype=dtype, device=device,
        )  # fmt: skip
        out = aiter_backend.paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
        ref = reference_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window)
        assert_close_rel(out, ref, dtype)


@needs_aiter
def test_aiter_falls_back_for_block_size_1(aiter_backend, device):
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [3, 1],
        [4, 9],
        block_size=1,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=device,
    )
    assert aiter_backend.attention_fallback_reason(q, k_cache) == "block_size"
    before = aiter_backend.fallbacks["paged_attention.block_size"]
    out = aiter_backend.paged_attention(q, k_cache, v_cache, meta, scale=0.25)
    assert aiter_backend.fallbacks["paged_attention.block_size"] == before + 1
    assert_close_rel(out, reference_attention(q, k_cache, v_cache, meta, 0.25), torch.float32)


@needs_aiter
def test_aiter_falls_back_for_head_dim_48(aiter_backend, device):
    # aiter's segment-reduce kernel does not compile for a head_dim that is not a power
    # of two (seen on an H200): the fallback runs it, counted
    q, k_cache, v_cache, meta, _ = make_attention_batch(
        [1, 6], [30, 9], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=48,
        dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    assert aiter_backend.attention_fallback_reason(q, k_cache) == "head_dim"
    before = aiter_backend.fallbacks["paged_attention.head_dim"]
    out = aiter_backend.paged_attention(q, k_cache, v_cache, meta, scale=0.25)
    assert aiter_backend.fallbacks["paged_attention.head_dim"] == before + 1
    ref = reference_attention(q, k_cache, v_cache, meta, 0.25)
    assert_close_rel(out, ref, torch.bfloat16)


@pytest.mark.gpu
@needs_aiter
def test_amd_only_launch_option_is_dropped_on_nvidia(aiter_backend):
    import triton
    import triton.language as tl

    if aiter_shims.is_rocm():
        pytest.skip("ROCm Triton accepts waves_per_eu")

    @triton.jit
    def _fill(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N).to(tl.float32))

    x = torch.zeros(16, device="cuda")
    with pytest.raises(KeyError, match="waves_per_eu"):
        _fill[(1,)](x, 16, waves_per_eu=2)  # what NVIDIA Triton does without the shim
    aiter_shims.drop_amd_launch_options(_fill)
    _fill[(1,)](x, 16, waves_per_eu=2)
    assert torch.equal(x.cpu(), torch.arange(16, dtype=torch.float32))


@needs_aiter
@pytest.mark.parametrize("t,e,top_k", [(1, 4, 1), (5, 8, 2), (17, 4, 4)])
def test_aiter_fused_moe_matches_reference(t, e, top_k, aiter_backend, device):
    """AITER's fused-MoE GEMMs behind pdserve's routing: equal to the torch reference,
    including experts no token picks (8 experts, 5 tokens, top-2) and every token on
    every expert (top_k == E)."""
    from services.kernels.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(t * 10 + e)
    h, inter = 32, 16
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    want = TorchBackend().fused_moe(x, logits, w13, w2, top_k, True)
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
    args = [v.to(device) for v in (x, logits, w13, w2)]
    before = aiter_backend.fallbacks["fused_moe.fp32"]
    out = aiter_backend.fused_moe(*args, top_k, True, config=small)
    assert out.shape == (t, h) and out.dtype == x.dtype
    assert_close_rel(out, want.to(device), torch.float32)
    assert torch.equal(args[0].cpu(), x)  # input untouched
    if device != "cpu":  # fp32 on a GPU: aiter's dots would be tf32, so the fallback ran
        assert aiter_backend.fallbacks["fused_moe.fp32"] == before + 1
        # bf16: aiter's own kernel, against the fp32 reference on the same bf16 inputs
        low = [v.to(device, torch.bfloat16) for v in (x, logits, w13, w2)]
        ref = TorchBackend().fused_moe(*[v.float().cpu() for v in low], top_k, True)
        got = aiter_backend.fused_moe(*low, top_k, True, config=small)
        assert aiter_backend.fallbacks["fused_moe.fp32"] == before + 1
        assert_close_rel(got, ref.to(device), torch.bfloat16)


@needs_aiter
def test_aiter_runs_fp8_experts_on_the_triton_fused_moe_visibly(aiter_backend, device, caplog):
    """FP8 experts: AITER's FP8 MoE kernels are not wired in, so the aiter backend runs
    pdserve's FP8 fused MoE, counted in `fallbacks` and logged once."""
    from services.kernels.fp8 import FP8_DTYPE, Fp8Experts, Fp8Format
    from services.kernels.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(7)
    fmt = Fp8Format("block", 16, 16)
    e, h, inter, t = 4, 32, 16, 3
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    w13 = (torch.rand(e, 2 * inter, h, generator=gen) * 2 - 1).mul(400).to(FP8_DTYPE)
    w2 = (torch.rand(e, h, inter, generator=gen) * 2 - 1).mul(400).to(FP8_DTYPE)
    s13 = torch.rand(e, 2 * inter // 16, h // 16, generator=gen) / 4000
    s2 = torch.rand(e, h // 16, inter // 16, generator=gen) / 4000
    want = TorchBackend().fused_moe(x, logits, w13, w2, 2, True, fp8=Fp8Experts(s13, s2, fmt))
    args = [v.to(device) for v in (x, logits, w13, w2)]
    fp8 = Fp8Experts(s13.to(device), s2.to(device), fmt)
    before = aiter_backend.fallbacks["fused_moe.fp8"]
    with caplog.at_level("WARNING"):
        out = aiter_backend.fused_moe(*args, 2, True, fp8=fp8)
    assert aiter_backend.fallbacks["fused_moe.fp8"] == before + 1
    assert before or "FP8 experts run the" in caplog.text
    assert_close_rel(out, want.to(device), torch.float32)
