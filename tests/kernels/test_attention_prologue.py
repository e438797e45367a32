"""rope_and_store_kv inside the decode attention launch (triton/attention_prologue.py):
the triton backend's attention_with_prologue with the prologue on against the same
backend's two launches (rope_and_store_kv, then paged_attention). Decode batches with
short and long contexts, one and several key splits, block sizes 16 and 1, GQA, Qwen3's
q/k norm, FP8 caches, sliding windows and padded rows; other layers of the block-major
cache untouched. Small sizes under Triton's interpreter on a CPU, where the two agree
bit for bit; compiled on a GPU the two kernels may contract a product into an FMA
differently (an H100 gave fp32 outputs a last bit apart), so there they agree within
the kernel tests' bound."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.interface import AttentionMetadata  # noqa: E402
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from services.models.rope import cos_sin_cache  # noqa: E402
from tests.kernels.helpers import DTYPES, assert_close_rel, make_attention_batch  # noqa: E402
from tests.kernels.test_triton_ops import LLAMA3_ROPE, _fused_qkv, _randn  # noqa: E402

CTX = [40, 3, 70, 16, 0]  # cached keys before this step's: block-aligned, short, none


def _case(dtype, device, heads=(8, 2, 32), block_size=16, ctx=CTX, cache_dtype=None, seed=0):
    hq, hk, d = heads
    _, k_cache, v_cache, meta, kv = make_attention_batch(
        [1] * len(ctx), ctx, block_size=block_size, num_q_heads=hq, num_kv_heads=hk,
        head_dim=d, dtype=dtype, device=device, seed=seed,
    )  # fmt: skip
    if cache_dtype is not None:  # an FP8 cache: the same values, stored in e4m3
        kv = (kv.float() * 8).to(cache_dtype)
    q, k, v = _fused_qkv(len(ctx), hq, hk, d, dtype, device, seed=seed + 1)
    positions = meta.seq_lens.long() - 1  # each row's newest position
    table = cos_sin_cache(d, 300, LLAMA3_ROPE).to(device)
    norm = (
        1 + 0.1 * _randn(d, dtype=dtype, device=device, seed=seed + 2),
        1 - 0.1 * _randn(d, dtype=dtype, device=device, seed=seed + 3),
        1e-6,
    )
    return positions, q, k, v, table, kv, meta, norm


def _attend(ops, positions, q, k, v, table, kv, meta, qk_norm=None, scales=(None, None), **kw):
    kv = kv.clone()
    meta = AttentionMetadata(**{**vars(meta), "backend_data": {}})
    out = ops.attention_with_prologue(
        positions, q, k, v, table, kv[:, 1, 0], kv[:, 1, 1], meta, q.shape[-1] ** -0.5,
        *scales, qk_norm, **kw,
    )  # fmt: skip
    return out, kv


def _same(a, b, dtype):
    """Bit for bit under the interpreter; within the kernel tests' bound on a GPU."""
    if a.device.type == "cpu":
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert_close_rel(a.float(), b.float(), dtype)


def _both(splits, *args, **kw):
    fused = TritonBackend(attn_num_splits=splits, attn_prologue=True)
    apart = TritonBackend(attn_num_splits=splits, attn_prologue=False)
    return _attend(fused, *args, **kw), _attend(apart, *args, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_prologue_in_the_attention_launch_equals_two_launches(dtype, block_size, splits, device):
    case = _case(dtype, device, block_size=block_size)
    (out, kv), (out_ref, kv_ref) = _both(splits, *case)
    assert out.dtype == dtype and out.shape == case[1].shape
    # the same roundings in the same order; other layers untouched
    _same(out, out_ref, dtype)
    _same(kv, kv_ref, dtype)
    assert not torch.equal(kv, case[5])  # this step's keys were written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 32), (4, 4, 16), (16, 1, 64)], ids=["gqa", "mha", "mqa"])
def test_qk_norm_in_the_attention_launch_tracks_two_launches(dtype, heads, device):
    """Qwen3's q/k norm: k is normed by one program's 1-D sum, rope_cache.py's by a 3-D
    one, so the last bit may differ; within the kernel tests' bound, v exactly."""
    positions, q, k, v, table, kv, meta, norm = _case(dtype, device, heads)
    (out, kv_out), (out_ref, kv_ref) = _both(4, positions, q, k, v, table, kv, meta, norm)
    assert_close_rel(out, out_ref.float(), dtype)
    assert_close_rel(kv_out[:, 1, 0], kv_ref[:, 1, 0].float(), dtype)
    assert torch.equal(kv_out[:, 1, 1], kv_ref[:, 1, 1])
    # and the torch reference in fp32
    q32, k32, v32, kv32 = q.float(), k.float(), v.float(), kv.float()
    norm32 = (norm[0].float(), norm[1].float(), norm[2])
    out32, _ = _attend(TorchBackend(), positions, q32, k32, v32, table, kv32, meta, norm32)
    assert_close_rel(out, out32, dtype)


@pytest.mark.parametrize("splits", [None, 4])
def test_prologue_with_an_fp8_cache_equals_two_launches(splits, device):
    fp8 = torch.float8_e4m3fn
    positions, q, k, v, table, kv, meta, _ = _case(torch.bfloat16, device, cache_dtype=fp8)
    scales = (0.25, 0.5)
    # values past e4m3's max once scaled: the saturation is exercised too
    args = (positions, q, 40 * k, 40 * v, table, kv, meta)
    (out, kv_out), (out_ref, kv_ref) = _both(splits, *args, scales=scales)
    _same(out, out_ref, torch.bfloat16)
    _same(kv_out, kv_ref, torch.bfloat16)
    assert kv_out[:, 1, 0].float().abs().max() == 448  # saturated somewhere


@pytest.mark.parametrize("window", [1, 8, 50])
def test_prologue_with_a_sliding_window_equals_two_launches(window, device):
    case = _case(torch.float32, device, ctx=[40, 70, 5])
    (out, kv), (out_ref, kv_ref) = _both(4, *case, sliding_window=window)
    _same(out, out_ref, torch.float32)
    _same(kv, kv_ref, torch.float32)


def test_padded_rows_write_no_cache(device):
    """A captured batch's padding rows (slot -1, in no sequence) write nothing."""
    positions, q, k, v, table, kv, meta, norm = _case(torch.float32, device, ctx=[40, 3])
    pad = 2  # two rows past the batch's sequences
    q, k, v = _fused_qkv(2 + pad, 8, 2, 32, torch.float32, device, seed=9)
    positions = torch.cat([positions, positions[:1].repeat(pad)])
    slots = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=meta.slot_mapping.device)])
    meta = AttentionMetadata(**{**vars(meta), "slot_mapping": slots, "backend_data": {}})
    (out, kv_out), (out_ref, kv_ref) = _both(None, positions, q, k, v, table, kv, meta)
    _same(out[:2], out_ref[:2], torch.float32)
    _same(kv_out, kv_ref, torch.float32)
    # the padded rows' slots stay as they were: only the real rows' slots changed
    changed = (kv_out != kv).flatten(1).any(1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted({s // 16 for s in meta.slot_mapping[:2].tolist()})


def test_prefill_rows_take_two_launches(device):
    """A batch with a longer query is outside the prologue's reach: two launches, the
    same result as with the prologue off."""
    _, k_cache, v_cache, meta, kv = make_attention_batch(
        [1, 5], [20, 3], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=32,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    q, k, v = _fused_qkv(6, 8, 2, 32, torch.float32, device, seed=3)
    positions = torch.tensor([20, 3, 4, 5, 6, 7], device=q.device)
    table = cos_sin_cache(32, 300, LLAMA3_ROPE).to(q.device)
    (out, kv_out), (out_ref, kv_ref) = _both(None, positions, q, k, v, table, kv, meta)
    assert torch.equal(out, out_ref) and torch.equal(kv_out, kv_ref)  # the same two launches


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRITON_ATTN_PROLOGUE", raising=False)
    assert TritonBackend().attn_prologue  # on by default
    monkeypatch.setenv("PDSERVE_TRITON_ATTN_PROLOGUE", "1")
    assert TritonBackend().attn_prologue
    monkeypatch.setenv("PDSERVE_TRITON_ATTN_PROLOGUE", "0")
    assert not TritonBackend().attn_prologue
    monkeypatch.setenv("PDSERVE_TRITON_ATTN_PROLOGUE", "yes")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_ATTN_PROLOGUE"):
        TritonBackend()
    assert not TritonBackend(attn_prologue=False).attn_prologue  # an explicit choice wins
