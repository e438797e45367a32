"""The torch backend's rotary embedding rotates q and k as one tensor when they are
neighbours in one fused qkv row (one decode row). It must only do so when they share a
storage: separate allocations can sit back to back (CUDA's caching allocator places
q_norm's and k_norm's outputs so), and a view over q's storage cannot reach k's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.kernels.torch_backend import TorchBackend  # noqa: E402

HQ, HK, D = 4, 2, 8


def cos_sin_cache(max_pos: int = 32) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D]: cos | sin


def neox_rotate(x: torch.Tensor, pos: int, cache: torch.Tensor) -> torch.Tensor:
    cos, sin = cache[pos, : D // 2], cache[pos, D // 2 :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def check(q: torch.Tensor, k: torch.Tensor, pos: int = 5) -> None:
    cache = cos_sin_cache()
    want_q, want_k = neox_rotate(q.clone(), pos, cache), neox_rotate(k.clone(), pos, cache)
    got_q, got_k = TorchBackend().rotary_embedding(torch.tensor([pos]), q, k, cache)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_q_and_k_of_one_fused_qkv_row():
    qkv = torch.randn(1, (HQ + 2 * HK) * D)
    q = qkv[:, : HQ * D].view(1, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(1, HK, D)
    check(q, k)


def test_q_and_k_back_to_back_in_separate_storages():
    raw = bytearray(4 * (HQ + HK) * D)
    view = memoryview(raw)
    q = torch.frombuffer(view[: 4 * HQ * D], dtype=torch.float32).view(1, HQ, D)
    k = torch.frombuffer(view[4 * HQ * D :], dtype=torch.float32).view(1, HK, D)
    q.copy_(torch.randn(1, HQ, D))
    k.copy_(torch.randn(1, HK, D))
    assert k.data_ptr() == q.data_ptr() + q.nbytes  # adjacent, as on the GPU
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    check(q, k)
