"""The cpu_native candidate (services/kernels/cpu_native): each C op equals the torch
reference (fp32 within rounding, bf16 bit for bit where the reference rounds the same
way), on the strided views the engine hands it (q, k, v as slices of the fused qkv row,
the per-layer KV cache views); what it does not cover goes to the reference; the
library is built once per machine and reused; a machine that cannot build it says why."""

from __future__ import annotations

import pytest
import torch

from services.kernels import cpu_native
from services.kernels.cpu_native import CpuNativeBackend
from services.kernels.interface import AttentionMetadata
from services.kernels.torch_backend import TorchBackend

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
HQ, HK, D, BS = 6, 2, 32, 16


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_KERNEL_TUNING_DIR", str(tmp_path_factory.mktemp("tuning")))
        return CpuNativeBackend()


REF = TorchBackend()


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check(out, ref, dtype, bf16_tol=0.0):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, ref) <= bf16_tol


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 5])
def test_norms_and_silu(native, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    h = 72
    base = torch.randn(rows, 2 * h, generator=gen).to(dtype)
    x = base[:, :h]  # a row stride of 2h: a slice, as the engine's views are
    residual = torch.randn(rows, h, generator=gen).to(dtype)
    weight = torch.randn(h, generator=gen).to(dtype)
    check(native.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6), dtype)
    out, res = native.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = REF.fused_add_rms_norm(x, residual, weight, 1e-6)
    check(out, ref_out, dtype)
    check(res, ref_res, dtype)
    assert torch.equal(residual, residual.clone())  # inputs untouched
    gate_up = torch.randn(rows, 2 * h, generator=gen).to(dtype)
    check(native.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), dtype)


def _batch(dtype, seqs, seed=0):
    """q, k, v as views of one fused qkv projection, two layers' KV caches as the
    runner's strided views of one allocation, the context before each new token
    filled, and the metadata of a step with these (query_len, seq_len) sequences."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(q for q, _ in seqs)
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(tokens, HQ, D), k.view(tokens, HK, D), v.view(tokens, HK, D)
    tables, positions, slots, nxt = [], [], [], 1  # block 0 unused
    for qlen, slen in seqs:
        nblocks = -(-slen // BS)
        tables.append(list(range(nxt, nxt + nblocks)))
        for i in range(qlen):
            positions.append(slen - qlen + i)
            slots.append(nxt * BS + slen - qlen + i)
        nxt += nblocks
    kv = torch.randn(nxt, HK, 2, 2, BS, D, generator=gen).to(
        dtype
    )  # [blocks, heads, layers, 2, ...]
    k_cache, v_cache = kv[:, :, 1, 0].transpose(1, 2), kv[:, :, 1, 1].transpose(1, 2)
    width = max(map(len, tables))
    cu = [0]
    for qlen, _ in seqs:
        cu.append(cu[-1] + qlen)
    lens = [s for _, s in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(lens),
        block_size=BS,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=lens,
    )
    cos_sin = torch.randn(512, D, generator=gen)
    return q, k, v, kv, k_cache, v_cache, torch.tensor(positions), cos_sin, meta


# decode rows only; prefill chunks after a cached prefix; a mix, one of them a 1-token
# context (a sequence's first token) and one longer than 8 blocks
BATCHES = {
    "decode": [(1, 37), (1, 1), (1, 160)],
    "prefill": [(20, 20), (7, 40)],
    "mixed": [(5, 37), (1, 100), (1, 17), (30, 30)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_rope_kv_write_and_attention(native, dtype, batch):
    q, k, v, kv, kc, vc, positions, cos_sin, meta = _batch(dtype, BATCHES[batch])
    kv_ref = kv.clone()
    kc_ref, vc_ref = kv_ref[:, :, 1, 0].transpose(1, 2), kv_ref[:, :, 1, 1].transpose(1, 2)
    # apart: rotary_embedding, then store_kv_cache
    q_rot, k_rot = native.rotary_embedding(positions, q, k, cos_sin)
    ref_q, ref_k = REF.rotary_embedding(positions, q, k, cos_sin)
    check(q_rot, ref_q, dtype)
    check(k_rot, ref_k, dtype)
    native.store_kv_cache(k_rot, v, kc, vc, meta.slot_mapping)
    REF.store_kv_cache(ref_k, v, kc_ref, vc_ref, meta.slot_mapping)
    check(kv, kv_ref, dtype)  # the other layer's half too: written nowhere else
    # fused: the rotated k straight into the cache
    kv.copy_(kv_ref.roll(1, dims=0))
    kv_ref.copy_(kv)
    q_out = native.rope_and_store_kv(positions, q, k, v, cos_sin, kc, vc, meta.slot_mapping)
    ref_out = REF.rope_and_store_kv(positions, q, k, v, cos_sin, kc_ref, vc_ref, meta.slot_mapping)
    check(q_out, ref_out, dtype)
    check(kv, kv_ref, dtype)
    # bf16: the reference attends in bf16, the C kernel in fp32 and rounds once
    for window in (None, 1, 5, 16, 33, 1000):  # a sliding window of 1 key .. wider than all
        out = native.paged_attention(q_out, kc, vc, meta, D**-0.5, sliding_window=window)
        ref = REF.paged_attention(ref_out, kc_ref, vc_ref, meta, D**-0.5, sliding_window=window)
        check(out, ref, dtype, bf16_tol=8e-3)


def test_what_it_does_not_cover_goes_to_the_reference(native):
    q, k, v, kv, kc, vc, positions, cos_sin, meta = _batch(torch.float32, BATCHES["mixed"])
    # an FP8 KV cache, a Qwen3 q/k norm, fp16: the reference's results exactly
    fp8 = torch.zeros(kc.shape, dtype=torch.float8_e4m3fn)
    fp8_ref = fp8.clone()
    scale = torch.tensor(0.5)
    native.store_kv_cache(k, v, fp8, fp8.clone(), meta.slot_mapping, scale, scale)
    REF.store_kv_cache(k, v, fp8_ref, fp8_ref.clone(), meta.slot_mapping, scale, scale)
    assert torch.equal(fp8.float(), fp8_ref.float())
    norm = (torch.ones(D), torch.ones(D), 1e-6)
    kc2, vc2 = kc.clone(), vc.clone()
    out = native.rope_and_store_kv(
        positions, q, k, v, cos_sin, kc, vc, meta.slot_mapping, qk_norm=norm
    )
    ref = REF.rope_and_store_kv(
        positions, q, k, v, cos_sin, kc2, vc2, meta.slot_mapping, qk_norm=norm
    )
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 40, dtype=torch.float16)
    w = torch.randn(40, dtype=torch.float16)
    assert torch.equal(native.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    # attention without host lengths (a captured step's metadata): the reference
    meta.cu_seqlens_q_cpu = None
    out = native.paged_attention(q.contiguous(), kc, vc, meta, 0.2)
    ref = REF.paged_attention(q.contiguous(), kc, vc, meta, 0.2)
    assert torch.equal(out, ref)


def test_the_library_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_TUNING_DIR", str(tmp_path))
    path = cpu_native.library_path()
    assert not path.exists() and path.is_relative_to(tmp_path)
    CpuNativeBackend()
    built = path.stat().st_mtime_ns
    assert list(path.parent.iterdir()) == [path]  # no temporary file left
    calls = []
    monkeypatch.setattr(cpu_native, "build", lambda p: calls.append(p))
    CpuNativeBackend()
    assert calls == [] and path.stat().st_mtime_ns == built


def test_an_unwritable_cache_builds_a_copy_of_its_own(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_TUNING_DIR", str(blocker / "tuning"))  # cannot exist
    x = torch.randn(2, 8)
    w = torch.randn(8)
    assert torch.allclose(CpuNativeBackend().rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    assert blocker.is_file()


def test_a_machine_that_cannot_build_it_says_why(tmp_path, monkeypatch, caplog):
    from services.kernels.candidates import load_candidates

    monkeypatch.setenv("PDSERVE_KERNEL_TUNING_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="building kernels.c failed"):
        CpuNativeBackend()
    caplog.set_level("INFO", logger="services.kernels.candidates")
    assert set(load_candidates(("torch", "cpu_native"))) == {"torch"}
    assert "kernel candidate cpu_native unavailable" in caplog.text
    assert not any(tmp_path.rglob("*.so"))


NATIVE_CHOICES = (
    "linear=torch,rms_norm=cpu_native,fused_add_rms_norm=cpu_native,"
    "rotary_embedding=cpu_native,store_kv_cache=cpu_native,silu_and_mul=cpu_native,"
    "paged_attention=cpu_native"
)


def test_the_engine_on_cpu_native_equals_the_torch_backend(tmp_path, monkeypatch):
    """Every small op on cpu_native (through the tuned backend's dispatch): the torch
    backend's greedy tokens in fp32, with prompts chunked beside decode rows and a
    cached prefix; every block back."""
    import random

    from services.engine import LLM, SamplingParams
    from tests.engine.helpers import assert_all_blocks_free, save_random_model

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = save_random_model(tmp_path / "llama", "llama")
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # 2.5 blocks: a cached prefix
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 30)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 17, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend, choices in (("torch", None), ("tuned", NATIVE_CHOICES)):
        llm = LLM(
            str(model), kernel_backend=backend, kernel_choices=choices, dtype="float32",
            block_size=16, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=256,
        )  # fmt: skip
        if choices:
            assert set(llm.engine.runner.ops.choices.values()) == {"torch", "cpu_native"}
        llm.generate(prompts[:1], params)  # the shared prefix is cached from here on
        outs[backend] = [o.output.token_ids for o in llm.generate(prompts, params)]
        assert_all_blocks_free(llm)
    assert outs["tuned"] == outs["torch"]
