"""FP8 on MI300 (gfx94x), whose e4m3 type is float8_e4m3fnuz, tested on the CPU by
forcing that type (load_model's fp8_dtype; on a GPU the platform decides,
fp8.platform_fp8_dtype).

- The platform decision: fnuz on gfx94x ROCm devices only.
- The conversion of an e4m3fn checkpoint (fp8.fn_to_fnuz, applied at load): the same
  bits (worth half in fnuz), 0x80 (-0 in fn, NaN in fnuz) -> 0, scales doubled: every
  weight dequantizes to exactly the checkpoint's value.
- The models: each FP8 checkpoint format loaded as fnuz, run on the torch backend (the
  reference: dequantized weights, activations quantized to fnuz with its max, 240),
  against transformers on the dequantized fp32 weights with the acceptance of
  tests/engine/fp8_helpers.py (logprobs within LOGPROB_TOL, greedy tokens equal on at
  least 7 of 8 prompts), exactly (1e-3) against transformers with activations
  quantized to fnuz the same way, and within LOGPROB_TOL of the same checkpoint loaded
  as e4m3fn. Each prompt runs as one prefill over the prompt and transformers' 8
  greedy tokens: the argmax at each of those positions is the greedy token."""

from __future__ import annotations

import pytest
import torch

from services.kernels import AttentionMetadata, get_backend
from services.kernels.fp8 import (
    FP8_DTYPE,
    FP8_FNUZ_DTYPE,
    Fp8Format,
    dequantize_weight,
    fn_to_fnuz,
    fp8_dtype_for_arch,
    platform_fp8_dtype,
    quantize_activation,
)
from services.models.loader import load_hf_config, load_model
from tests.engine.fp8_helpers import (
    BLOCK,
    LOGPROB_TOL,
    MAX_TOKENS,
    fake_quant_activations,
    fp8_layers,
    is_proj,
    prompts,
)
from tests.engine.helpers import hf_greedy, hf_load, hf_logprobs
from tests.engine.test_fp8_block_compressed_tensors import IGNORED, ct_block  # noqa: F401
from tests.engine.test_fp8_checkpoints import (  # noqa: F401 - fixtures
    CT_IGNORED,
    block_fp8,
    compressed_tensors,
    unquantized,
)

FNUZ = FP8_FNUZ_DTYPE


def test_the_platform_decides_fnuz_on_mi300_only():
    for arch in ("gfx942:sramecc+:xnack-", "gfx942", "gfx941", "gfx940"):
        assert fp8_dtype_for_arch(arch) == FNUZ, arch
    for arch in ("gfx950", "gfx90a", "gfx1100", None, ""):
        assert fp8_dtype_for_arch(arch) == FP8_DTYPE, arch
    assert platform_fp8_dtype("cpu") == FP8_DTYPE
    assert platform_fp8_dtype(None) == FP8_DTYPE
    assert torch.finfo(FNUZ).max == 240


def test_fn_to_fnuz_dequantizes_to_exactly_the_checkpoint_values():
    gen = torch.Generator().manual_seed(0)
    # every e4m3fn bit pattern but its NaNs (0x7f, 0xff), twice, shuffled into 320 x 260
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    bits = torch.tensor(finite * 2, dtype=torch.uint8)
    pick = torch.randint(len(bits), (320 * 260,), generator=gen)
    pick[: len(bits)] = torch.arange(len(bits))
    weight = bits[pick].view(FP8_DTYPE).view(320, 260)
    for fmt in (Fp8Format("block", BLOCK, BLOCK), Fp8Format("channel"), Fp8Format("tensor")):
        scale = torch.rand(fmt.scale_shape(320, 260), generator=gen) * 1e-2 + 1e-4
        q, s = fn_to_fnuz(weight, scale)
        assert q.dtype == FNUZ and torch.equal(s, scale * 2)
        want = dequantize_weight(weight, scale, fmt)
        got = dequantize_weight(q, s, fmt)
        assert not got.isnan().any()
        assert torch.equal(got, want), fmt  # bit for bit
    # -0 (0x80) is fnuz's NaN: it becomes +0; every other pattern keeps its bits
    q, _ = fn_to_fnuz(bits.view(FP8_DTYPE))
    out = q.view(torch.uint8)
    assert (out[bits == 0x80] == 0).all()
    assert torch.equal(out[bits != 0x80], bits[bits != 0x80])


def test_fnuz_activations_are_quantized_with_its_max():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    q, s = quantize_activation(x, BLOCK, FNUZ)
    assert q.dtype == FNUZ
    groups = torch.nn.functional.pad(x, (0, 84)).view(6, 3, BLOCK).abs().amax(-1)
    torch.testing.assert_close(s, groups / 240, rtol=0, atol=0)
    assert q.float().abs().amax().item() == 240.0
    full = s.repeat_interleave(BLOCK, 1)[:, :300]
    # 3 mantissa bits; below 2^-7 (subnormals) steps of 2^-10, times the scale
    assert ((q.float() * full - x).abs() <= x.abs() / 16 + full * 2**-11).all()


# ---- the models ------------------------------------------------------------------------
def _load(path, fp8_dtype, quantization=None, load_format="auto"):
    ops = get_backend("torch")
    model = load_model(
        load_hf_config(path),
        path,
        ops,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_position=1024,
        quantization=quantization,
        load_format=load_format,
        fp8_dtype=fp8_dtype,
    )
    return model, ops


@torch.inference_mode()
def _logprobs(model, ops, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """log_softmax of the model's logits at every position of one prefill: [T, vocab]."""
    n = len(token_ids)
    blocks = -(-n // block_size)
    for attn in model.attention_layers():
        shape = (blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        block_size=block_size,
        cu_seqlens_q_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    ops.prepare_attention(meta)
    hidden = model(torch.tensor(token_ids), torch.arange(n), meta)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def _check(fnuz, fn, reference, emulated):
    """fnuz / fn: (model, ops); reference: transformers on the dequantized fp32
    weights; emulated: the same with activations quantized to fnuz as the kernels do."""
    agree, worst, gap = 0, 0.0, 0.0
    for prompt in prompts():
        tokens = hf_greedy(reference, prompt, MAX_TOKENS, ignore_eos=True)
        seq = prompt + tokens
        at = torch.arange(len(prompt) - 1, len(seq) - 1)  # the positions choosing `tokens`
        chosen = torch.tensor(tokens)
        ours = _logprobs(*fnuz, seq)[at]
        ref = hf_logprobs(reference, seq)[at]
        agree += torch.equal(ours.argmax(-1), chosen)
        rows = torch.arange(len(at))
        worst = max(worst, (ours - ref)[rows, chosen].abs().max().item())
        exact = hf_logprobs(emulated, seq)[at]
        assert torch.equal(ours.argmax(-1), exact.argmax(-1))
        torch.testing.assert_close(ours[rows, chosen], exact[rows, chosen], rtol=0, atol=1e-3)
        other = _logprobs(*fn, seq)[at]
        gap = max(gap, (ours - other)[rows, chosen].abs().max().item())
    assert worst <= LOGPROB_TOL, f"fnuz: logprob differs from transformers by {worst:.3g}"
    assert agree >= 7, f"fnuz: greedy tokens equal on {agree}/8 prompts only"
    # both are W8A8 within LOGPROB_TOL of the same fp32 reference; their activations
    # round to different grids (240 vs 448 is not a power of two), so they are within
    # twice that of each other (their weights are identical: _same_values)
    assert gap <= 2 * LOGPROB_TOL, f"fnuz and fn models differ by {gap:.3g} nats"


def _same_values(fnuz_model, fn_model):
    """The fnuz model's FP8 layers hold the fn model's weights, value for value."""
    fnuz, fn = fp8_layers(fnuz_model), fp8_layers(fn_model)
    assert fnuz and set(fnuz) == set(fn)
    for name, layer in fnuz.items():
        assert layer.weight.dtype == FNUZ and fn[name].weight.dtype == FP8_DTYPE
        fmt = layer.fp8_format
        want = dequantize_weight(fn[name].weight, fn[name].weight_scale, fmt)
        assert torch.equal(dequantize_weight(layer.weight, layer.weight_scale, fmt), want), name


def _checkpoint_as_fnuz(qdir, reference, group, skip=()):
    fnuz, fn = _load(qdir, FNUZ), _load(qdir, FP8_DTYPE)
    _same_values(fnuz[0], fn[0])
    emulated = fake_quant_activations(hf_load(reference), group, skip, dtype=FNUZ)
    _check(fnuz, fn, hf_load(reference), emulated)


def test_block_fp8_weight_scale_inv_as_fnuz(block_fp8):  # noqa: F811
    _checkpoint_as_fnuz(*block_fp8, group=BLOCK)


def test_compressed_tensors_fp8_block_as_fnuz(ct_block):  # noqa: F811
    _checkpoint_as_fnuz(*ct_block, group=BLOCK, skip=[IGNORED])


def test_compressed_tensors_fp8_dynamic_as_fnuz(compressed_tensors):  # noqa: F811
    _, qdir, reference = compressed_tensors  # channel, then tensor weight scales
    _checkpoint_as_fnuz(qdir, reference, group=None, skip=[CT_IGNORED])


def test_online_fnuz_quantization_tracks_transformers(unquantized):  # noqa: F811
    """An unquantized checkpoint quantized at load straight to fnuz (per channel,
    scale = amax / 240), against transformers on the checkpoint itself and, exactly, on
    its weights quantized so by this test."""
    qdir, _ = unquantized
    fnuz = _load(qdir, FNUZ, quantization="fp8")
    fn = _load(qdir, FP8_DTYPE, quantization="fp8")
    assert all(m.weight.dtype == FNUZ for m in fp8_layers(fnuz[0]).values())
    emulated = hf_load(qdir)
    with torch.no_grad():
        for name, p in emulated.named_parameters():
            if is_proj(name):
                scale = p.abs().amax(dim=1, keepdim=True) / 240
                p.copy_((p / scale).clamp(-240, 240).to(FNUZ).float() * scale)
    _check(fnuz, fn, hf_load(qdir), fake_quant_activations(emulated, None, dtype=FNUZ))


def test_dummy_fnuz_weights_stay_in_range(block_fp8):  # noqa: F811
    model, _ = _load(block_fp8[0], FNUZ, load_format="dummy")
    for name, layer in fp8_layers(model).items():
        w = layer.weight.float()
        assert layer.weight.dtype == FNUZ and not w.isnan().any(), name
        assert w.abs().max() <= 240
        deq = dequantize_weight(layer.weight, layer.weight_scale, layer.fp8_format)
        assert deq.abs().max() <= 0.05 + 1e-6


def test_a_forced_fp8_dtype_must_be_an_e4m3_type(block_fp8):  # noqa: F811
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        _load(block_fp8[0], torch.float8_e5m2)


def test_an_fnuz_kv_cache_on_the_torch_backend():
    """The KV ops take an fnuz cache (the engine still allocates e4m3fn caches: the
    choice is model_runner.py's): stores saturate at +-240 and round to fnuz, attention
    reads stored * scale."""
    from services.kernels.torch_backend import TorchBackend

    ops, gen = TorchBackend(), torch.Generator().manual_seed(2)
    n, heads, dim, bs = 20, 2, 16, 8
    k, v = (torch.randn(n, heads, dim, generator=gen) * 40 for _ in range(2))
    k_cache, v_cache = (torch.zeros(3, bs, heads, dim, dtype=FNUZ) for _ in range(2))
    slots = torch.arange(n)
    ops.store_kv_cache(k, v, k_cache, v_cache, slots, 0.25, 0.5)
    stored = k_cache[slots // bs, slots % bs].float()
    inside = (k / 0.25).abs() <= 240
    assert (~inside).any() and (stored[~inside].abs() == 240).all()  # saturated, no NaN
    assert torch.equal(stored[inside], (k / 0.25)[inside].to(FNUZ).float())
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(3, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        block_size=bs,
    )
    q = torch.randn(n, 4, dim, generator=gen)
    out = ops.paged_attention(q, k_cache, v_cache, meta, dim**-0.5, 0.25, 0.5)
    want = ops.paged_attention(q, k_cache.float() * 0.25, v_cache.float() * 0.5, meta, dim**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
