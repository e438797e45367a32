"""The attention prologue in one launch (triton/rope_cache.py): the triton backend's
fused rope_and_store_kv against the same ops one by one (rope_and_store_kv_unfused),
and the tuned backend fusing only where one backend won every op it covers. Small
sizes under Triton's interpreter on a CPU, as the other kernel tests."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from services.kernels.interface import rope_and_store_kv_unfused  # noqa: E402
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.triton_backend import TritonBackend  # noqa: E402
from services.kernels.tuned_backend import TunedBackend  # noqa: E402
from services.models.rope import cos_sin_cache  # noqa: E402
from tests.kernels.helpers import DTYPES, assert_close_rel  # noqa: E402
from tests.kernels.test_triton_ops import LLAMA3_ROPE, _fused_qkv, _randn  # noqa: E402

REF = TorchBackend()
TRI = TritonBackend()


def _case(dtype, device, heads=(8, 2, 16), tokens=10, block_size=16, cache_dtype=None):
    hq, hk, d = heads
    q, k, v = _fused_qkv(tokens, hq, hk, d, dtype, device, seed=21)
    table = cos_sin_cache(d, 300, LLAMA3_ROPE).to(device)
    g = torch.Generator().manual_seed(22)
    positions = torch.randint(0, 300, (tokens,), generator=g).to(device)
    num_blocks = 2 * tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(device)
    # the engine's block-major cache: [blocks, layers, 2, block_size, Hk, D], layer 1
    kv = torch.zeros(num_blocks, 3, 2, block_size, hk, d, dtype=cache_dtype or dtype, device=device)
    norm = (
        1 + 0.1 * _randn(d, dtype=dtype, device=device, seed=23),
        1 - 0.1 * _randn(d, dtype=dtype, device=device, seed=24),
        1e-6,
    )
    return positions, q, k, v, table, kv, slots, norm


def _run(ops, positions, q, k, v, table, kv, slots, qk_norm, scales=(None, None)):
    kv = kv.clone()
    q_out = ops.rope_and_store_kv(
        positions, q, k, v, table, kv[:, 1, 0], kv[:, 1, 1], slots, *scales, qk_norm
    )
    return q_out, kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 16), (6, 3, 24)])
@pytest.mark.parametrize("block_size", [16, 1])
def test_fused_rope_and_kv_write_equal_the_ops_one_by_one(dtype, heads, block_size, device):
    positions, q, k, v, table, kv, slots, _ = _case(dtype, device, heads, block_size=block_size)
    q_out, kv_out = _run(TRI, positions, q, k, v, table, kv, slots, None)
    kv_ref = kv.clone()
    q_ref = rope_and_store_kv_unfused(
        TRI, positions, q, k, v, table, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots
    )
    assert q_out.dtype == dtype and q_out.shape == q.shape and q_out.is_contiguous()
    # the same roundings in the same order: the same bits, other layers untouched
    assert torch.equal(q_out, q_ref)
    assert torch.equal(kv_out, kv_ref)
    assert kv_out[:, 1].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 16), (6, 3, 24)])
def test_fused_qk_norm_tracks_the_torch_reference(dtype, heads, device):
    """With Qwen3's per-head q/k RMSNorm in the same launch: within the kernel tests'
    bound of the fp32 torch ops one by one (the fused sum of squares adds a head's two
    halves, so it may round otherwise than rms_norm's single sum)."""
    positions, q, k, v, table, kv, slots, norm = _case(dtype, device, heads)
    q_out, kv_out = _run(TRI, positions, q, k, v, table, kv, slots, norm)
    norm32 = (norm[0].float(), norm[1].float(), norm[2])
    q_ref, kv_ref = _run(
        REF, positions, q.float(), k.float(), v.float(), table, kv.float(), slots, norm32
    )
    assert_close_rel(q_out, q_ref, dtype)
    assert_close_rel(kv_out[:, 1, 0], kv_ref[:, 1, 0], dtype)
    assert torch.equal(kv_out[:, 1, 1], kv_ref[:, 1, 1].to(dtype))  # v: a copy
    # and against the triton ops one by one, in the model's dtype
    q_tri, kv_tri = _run(TritonUnfused(), positions, q, k, v, table, kv, slots, norm)
    assert_close_rel(q_out, q_tri.float(), dtype)
    assert_close_rel(kv_out[:, 1, 0], kv_tri[:, 1, 0].float(), dtype)


def test_fused_prologue_skips_padding_slots(device):
    positions, q, k, v, table, kv, slots, norm = _case(torch.float32, device, tokens=6)
    free = sorted(set(range(kv.shape[0] * kv.shape[3])) - set(slots.tolist()))
    everywhere = slots.clone()
    everywhere[[1, 4]] = torch.tensor(free[:2], device=slots.device)
    slots[[1, 4]] = -1  # padded rows of a captured batch
    q_out, kv_out = _run(TRI, positions, q, k, v, table, kv, slots, norm)
    q_all, kv_all = _run(TRI, positions, q, k, v, table, kv, everywhere, norm)
    assert torch.equal(q_out, q_all)  # q is rotated for every row
    # the real rows' K and V where they belong; nothing at all for the padded ones
    flat = kv_all.clone()
    for s in free[:2]:
        flat[s // kv.shape[3], 1, :, s % kv.shape[3]] = 0
    assert torch.equal(kv_out, flat)
    assert not torch.equal(kv_all, flat)


def test_fused_prologue_fp8_cache_equals_the_ops_one_by_one(device):
    fp8 = torch.float8_e4m3fn
    positions, q, k, v, table, kv, slots, norm = _case(torch.bfloat16, device, cache_dtype=fp8)
    q = q * 40  # values past e4m3's max once scaled: saturation is exercised too
    scales = (0.25, 0.5)
    q_out, kv_out = _run(TRI, positions, q, 40 * k, 40 * v, table, kv, slots, None, scales)
    kv_ref = kv.clone()
    q_ref = rope_and_store_kv_unfused(
        TRI, positions, q, 40 * k, 40 * v, table, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots,
        *scales,
    )  # fmt: skip
    assert torch.equal(q_out, q_ref)
    assert torch.equal(kv_out.view(torch.uint8), kv_ref.view(torch.uint8))
    assert kv_out.float().abs().max() == 448  # saturated somewhere


class TritonUnfused(TritonBackend):
    """The triton ops one by one (what the backend ran before the fused kernel)."""

    def rope_and_store_kv(self, *args):
        return rope_and_store_kv_unfused(self, *args)


class Recording(TritonBackend):
    def __init__(self, name):
        super().__init__()
        self.name, self.calls = name, []

    def rope_and_store_kv(self, *args):
        self.calls.append("rope_and_store_kv")
        return super().rope_and_store_kv(*args)

    def rms_norm(self, x, weight, eps):
        self.calls.append("rms_norm")
        return super().rms_norm(x, weight, eps)

    def rotary_embedding(self, *args):
        self.calls.append("rotary_embedding")
        return super().rotary_embedding(*args)

    def store_kv_cache(self, *args):
        self.calls.append("store_kv_cache")
        return super().store_kv_cache(*args)


@pytest.mark.parametrize("split", [None, "rms_norm", "store_kv_cache"])
def test_tuned_backend_fuses_only_when_one_backend_won_every_op(split, device):
    """decode8 tokens: with one winner for rotary_embedding, store_kv_cache and (with a
    q/k norm) rms_norm, the tuned backend calls that winner's fused op; when another
    backend won one of them, each op runs on its own winner."""
    a, b = Recording("a"), Recording("b")
    ops = ("rms_norm", "rotary_embedding", "store_kv_cache")
    from services.kernels.shape_classes import all_keys

    choices = dict.fromkeys(all_keys(), "a")
    choices.update({f"{op}.decode8": "b" for op in ops if op == split})
    tuned = TunedBackend({"a": a, "b": b}, choices)
    positions, q, k, v, table, kv, slots, norm = _case(torch.float32, device, tokens=5)
    q_out, kv_out = _run(tuned, positions, q, k, v, table, kv, slots, norm)
    q_ref, kv_ref = _run(TRI, positions, q, k, v, table, kv, slots, norm)
    if split is None:
        assert a.calls == ["rope_and_store_kv"] and b.calls == []
        assert torch.equal(q_out, q_ref) and torch.equal(kv_out, kv_ref)
    else:
        assert "rope_and_store_kv" not in a.calls + b.calls
        assert b.calls == [split] * (2 if split == "rms_norm" else 1)
        assert_close_rel(q_out, q_ref, torch.float32)
        assert_close_rel(kv_out, kv_ref, torch.float32)
    # without a q/k norm only the other two ops decide
    a.calls.clear(), b.calls.clear()
    _run(tuned, positions, q, k, v, table, kv, slots, None)
    fused = split != "store_kv_cache"
    assert ("rope_and_store_kv" in a.calls) == fused
