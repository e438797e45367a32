"""FP8 KV cache (kv_cache_dtype fp8_e4m3): the KV write quantizes (x / scale, saturated
to +-448, rounded to nearest even) and paged attention reads float8_e4m3fn and
multiplies by the scale. pdserve's Triton kernels (Triton's interpreter on a CPU), the
sdpa and aiter backends against the torch reference, with scales other than 1.0."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.interface import FP8_E4M3_MAX, FP8_KV_DTYPE  # noqa: E402
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.helpers import assert_close_rel, make_attention_batch  # noqa: E402

MIXED = ([1, 1, 37, 5, 1, 16], [40, 3, 20, 0, 70, 32])  # decode rows + chunks, as elsewhere


def _store_inputs(dtype, device, n=48, heads=2, dim=32):
    gen = torch.Generator().manual_seed(3)
    # magnitudes from 1e-4 to 1e3: e4m3 subnormals, normals and saturation
    mag = torch.logspace(-4, 3, n).view(n, 1, 1)
    k = torch.randn(n, heads, dim, generator=gen) * mag
    v = torch.randn(n, heads, dim, generator=gen) * 10
    # exact ties between two e4m3 neighbours round to the even one: 1.0625 -> 1.0,
    # 1.1875 -> 1.25; beyond the range saturates
    k[0, 0, :4] = torch.tensor([1.0625, 1.1875, -1.0625, 1e4])
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(None, None), (0.37, 2.5)], ids=["unscaled", "scaled"])
def test_triton_kv_write_quantizes_like_the_reference(dtype, scales, device):
    k, v = _store_inputs(dtype, device)
    n = k.shape[0]
    # a layer's strided view of a block-major [blocks, layers, 2, bs, Hk, D] cache
    kv = torch.zeros(8, 2, 2, 16, 2, 32, dtype=FP8_KV_DTYPE, device=device)
    ref = kv.clone()
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(0))[:n].to(device)
    slots[5] = -1  # a padded CUDA-graph row: skipped
    TritonBackend().store_kv_cache(k, v, kv[:, 1, 0], kv[:, 1, 1], slots, *scales)
    keep = slots >= 0
    TorchBackend().store_kv_cache(
        k[keep], v[keep], ref[:, 1, 0], ref[:, 1, 1], slots[keep], *scales
    )
    assert torch.equal(kv.float(), ref.float())  # bit-for-bit (as values) the reference
    # and the reference is what the interface promises: round-to-nearest of x / scale
    k_scale = scales[0] or 1.0
    bs = 16
    blocks, offs = slots[keep] // bs, slots[keep] % bs
    stored = kv[blocks, 1, 0, offs].float() * k_scale
    want = k[keep].float()
    inside = want.abs() / k_scale <= FP8_E4M3_MAX
    # half a step: of a 3-bit mantissa for normals, of the fixed 2^-9 below 2^-6
    half_step = torch.maximum(want.abs() * 2**-4, torch.tensor(2**-10 * k_scale))
    assert ((stored - want).abs() <= half_step * (1 + 1e-6))[inside].all()
    raw = kv[blocks, 1, 0, offs].float()
    assert (raw[~inside].abs() == FP8_E4M3_MAX).all() and (~inside).any()  # saturated, no NaN
    if scales[0] is None:
        first = kv[slots[0] // bs, 1, 0, slots[0] % bs, 0, :4].float().tolist()
        assert first == [1.0, 1.25, -1.0, FP8_E4M3_MAX]


def _fp8_batch(dtype, device, k_scale, v_scale, block_size=16):
    q, k_cache, v_cache, meta, kv = make_attention_batch(
        *MIXED,
        block_size=block_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        device=device,
    )
    # the same block-major layout in FP8, holding (values / scale) as the KV write does
    kv8 = torch.empty(kv.shape, dtype=FP8_KV_DTYPE, device=kv.device)
    kv8[:, :, 0] = (kv[:, :, 0] * 3 / (k_scale or 1.0)).to(FP8_KV_DTYPE)
    kv8[:, :, 1] = (kv[:, :, 1] * 3 / (v_scale or 1.0)).to(FP8_KV_DTYPE)
    return q.to(dtype), kv8[:, 1, 0], kv8[:, 1, 1], meta


def _reference(q, k8, v8, meta, scale, k_scale, v_scale):
    """fp32 attention over the dequantized cache (the torch backend's wide-cache path)."""
    k = k8.float() * (k_scale or 1.0)
    v = v8.float() * (v_scale or 1.0)
    return TorchBackend().paged_attention(q.float(), k, v, _fresh(meta), 32**-0.5)


def _fresh(meta):
    from services.kernels.interface import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
        cu_seqlens_q_cpu=meta.cu_seqlens_q_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "splits,scales",
    [(None, (None, None)), (None, (0.05, 4.0)), (4, (0.05, 4.0))],
    ids=["unscaled", "scaled", "scaled_split_kv"],
)
def test_triton_attention_reads_fp8(dtype, splits, scales, device):
    q, k8, v8, meta = _fp8_batch(dtype, device, *scales)
    ref = _reference(q, k8, v8, meta, 32**-0.5, *scales)
    for backend in (TorchBackend(), TritonBackend(attn_num_splits=splits)):
        out = backend.paged_attention(q, k8, v8, _fresh(meta), 32**-0.5, *scales)
        assert out.dtype == dtype
        assert_close_rel(out, ref, dtype, scale=1.0 if dtype == torch.float32 else 1.5)
    if scales[0] is not None:  # the scales matter: reading without them is far off
        blind = TritonBackend().paged_attention(q, k8, v8, _fresh(meta), 32**-0.5)
        assert ((blind.float() - ref).norm() / ref.norm()).item() > 0.5


def test_sdpa_reads_fp8(device):
    from services.kernels.sdpa_backend import SdpaBackend

    q, k8, v8, meta = _fp8_batch(torch.float32, device, 0.05, 4.0)
    out = SdpaBackend().paged_attention(q, k8, v8, _fresh(meta), 32**-0.5, 0.05, 4.0)
    assert_close_rel(out, _reference(q, k8, v8, meta, 32**-0.5, 0.05, 4.0), torch.float32)


def test_scales_need_an_fp8_cache_and_other_8_bit_formats_are_refused(device):
    k = torch.randn(2, 2, 32, device=device)
    wide = torch.zeros(4, 16, 2, 32, device=device)
    slots = torch.tensor([0, 1], device=device)
    for backend in (TorchBackend(), TritonBackend()):
        with pytest.raises(ValueError, match="FP8 KV cache only"):
            backend.store_kv_cache(k, k, wide, wide, slots, 0.5, 0.5)
        e5m2 = torch.zeros(4, 16, 2, 32, dtype=torch.float8_e5m2, device=device)
        with pytest.raises(ValueError, match="float8_e5m2 is not supported"):
            backend.store_kv_cache(k, k, e5m2, e5m2, slots)


def test_aiter_runs_fp8_attention_on_its_triton_fallback_visibly(device, caplog):
    from services.kernels import aiter_shims, get_backend

    if aiter_shims.installed_version() is None:
        pytest.skip("amd-aiter is not installed (pip install amd-aiter)")
    backend = get_backend("aiter")
    q, k8, v8, meta = _fp8_batch(torch.float32, device, 0.05, 4.0)
    ref = _reference(q, k8, v8, meta, 32**-0.5, 0.05, 4.0)
    with caplog.at_level(logging.WARNING, logger="services.kernels.aiter_backend"):
        for _ in range(2):
            out = backend.paged_attention(q, k8, v8, _fresh(meta), 32**-0.5, 0.05, 4.0)
            assert_close_rel(out, ref, torch.float32)
    assert backend.fallbacks["paged_attention.fp8_kv"] == 2
    assert [r.getMessage() for r in caplog.records if "FP8 KV" in r.getMessage()] == [
        "aiter backend: FP8 KV cache: paged attention runs the triton backend's kernel"
    ]


def test_tuner_measures_kv_ops_on_a_scaled_fp8_cache(device):
    """With kv_cache_dtype fp8_e4m3 the tuner's KV write and attention cases run on an
    FP8 cache with scales 0.5 / 2.0: the real candidates match the fp32 reference, and
    one that ignored the scales would be rejected (its error is far above the bound)."""
    from services.kernels.shape_classes import KernelShapes
    from services.kernels.tuner import REL_TOL, TuningSizes
    from services.kernels.tuner_cases import rel_err, run_case

    shapes = KernelShapes(64, 4, 2, 16, 96, 16, "bfloat16", kv_cache_dtype="fp8_e4m3")
    sizes = TuningSizes.tiny()
    device = torch.device(device)
    tol = REL_TOL[torch.bfloat16]
    ref_backend, triton = TorchBackend(), TritonBackend()
    for op, cls in (("store_kv_cache", "decode8"), ("paged_attention", "mixed")):
        ref = run_case(op, cls, shapes, sizes, device, torch.float32, ref_backend)[1]
        if op == "store_kv_cache":
            assert ref.dtype == FP8_KV_DTYPE
        for backend in (ref_backend, triton):
            out = run_case(op, cls, shapes, sizes, device, shapes.torch_dtype, backend)[1]
            assert rel_err(out, ref) <= tol, (op, backend.name)

    class ScaleBlind(TritonBackend):  # a deliberately wrong candidate: drops the scales
        def paged_attention(self, q, k_cache, v_cache, metadata, scale, k_scale=None, v_scale=None):
            return super().paged_attention(q, k_cache, v_cache, metadata, scale)

    ref = run_case("paged_attention", "mixed", shapes, sizes, device, torch.float32, ref_backend)
    blind = run_case("paged_attention", "mixed", shapes, sizes, device, torch.float32, ScaleBlind())
    assert rel_err(blind[1], ref[1]) > 10 * tol
