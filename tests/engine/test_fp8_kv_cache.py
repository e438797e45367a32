"""FP8 KV cache in the engine (kv_cache_dtype fp8_e4m3 / fp8): it tracks the engine with
the KV in the model's dtype, holds more blocks for the same memory, frees every block,
and reads the checkpoint's k_scale / v_scale under the names vLLM accepts.

Tolerance, and why: e4m3 keeps 3 mantissa bits, so each cached K / V element is off by
up to 6.25% (relative). On SmolLM2 with the text prompts below that moves a generated
token's logprob by 0.04 nats on average and 0.41 at most (measured), and the greedy
continuations first differ after 11 tokens or more (where two candidates are nearly tied).
The test allows mean <= 0.1 and max <= 1.0 nats over the positions where both engines
saw the same context, and the first 8 greedy tokens equal on at least 7 of 8 prompts.
The FP8 engine itself is exact: it equals an fp32-KV engine whose K / V were rounded to
e4m3 first (checked while writing this; the kernels' tests check the rounding)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, save_random_model
from tests.engine.test_greedy_reference import TEXT_PROMPTS

MEAN_TOL, MAX_TOL = 0.1, 1.0  # nats, see the module docstring
SAME_PREFIX = 8  # greedy tokens that must agree (on 7 of 8 prompts)


def _compare(ref_outs, outs):
    """(prompts whose first SAME_PREFIX tokens agree, |delta logprob| of the reference's
    token at every position where both had the same context)."""
    agree, deltas = 0, []
    for a, b in zip(ref_outs, outs):
        ta, tb = a.output.token_ids, b.output.token_ids
        agree += ta[:SAME_PREFIX] == tb[:SAME_PREFIX]
        first_diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta) - 1)
        for i in range(first_diff + 1):  # the step that diverges still saw the same context
            mine, theirs = a.output.logprobs[i], b.output.logprobs[i]
            if ta[i] in theirs:  # else it fell out of the other's top 5: counted as far off
                deltas.append(abs(mine[ta[i]].logprob - theirs[ta[i]].logprob))
            else:
                deltas.append(float("inf"))
    return agree, deltas


def test_fp8_kv_tracks_the_model_dtype_kv_engine(colocated, model):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    prompts = [colocated.tokenizer.encode(p) for p in TEXT_PROMPTS]
    fp8 = LLM(model, kv_cache_dtype="fp8")
    spec = fp8.engine.runner.kv_spec
    assert spec.dtype == torch.float8_e4m3fn and fp8.engine.runner.kv_cache.element_size() == 1
    assert spec.k_scales == spec.v_scales == (1.0,) * 30  # SmolLM2 ships no KV scales
    ref = colocated.generate(prompts, params)
    outs = fp8.generate(prompts, params)
    agree, deltas = _compare(ref, outs)
    assert agree >= 7, f"greedy tokens agree on {agree} of 8 prompts"
    assert max(deltas) <= MAX_TOL and sum(deltas) / len(deltas) <= MEAN_TOL, (
        f"max {max(deltas):.3f}, mean {sum(deltas) / len(deltas):.3f} nats"
    )
    assert_all_blocks_free(fp8)


def test_the_pool_holds_more_blocks_for_the_same_memory(tmp_path):
    path = str(save_random_model(tmp_path / "llama", "llama"))
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8_e4m3")):
        llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=0.01)
        blocks[dtype, kv] = llm.engine.block_manager.num_blocks
        assert llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size() <= (
            0.01 * (1 << 30)
        )
    # 3 layers x 2 x 16 tokens x 2 heads x 16 dims per block: 12 KiB fp32, 3 KiB FP8
    elements, budget = 3 * 2 * 16 * 2 * 16, int(0.01 * (1 << 30))
    assert blocks["float32", "auto"] == budget // (elements * 4)
    assert blocks["bfloat16", "auto"] == budget // (elements * 2)
    assert blocks["float32", "fp8_e4m3"] == budget // elements  # 4x fp32, 2x bf16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model=path, kv_cache_dtype="fp8_e5m2")


# Each layer's scales under another of the spellings vLLM reads: llm-compressor /
# AutoFP8 (self_attn.k_scale, a 0-d tensor), compressed-tensors (k_proj.output_scale,
# shape [1]) and the deprecated single kv_scale. Powers of two, so that rounding
# x / scale to e4m3 is rounding x, scaled, except for the few values that leave e4m3's
# subnormal range (below 2^-6) and gain precision: the engine must then equal the
# unscaled one within 0.01 nats (0.002 measured; a scale applied on write but not on
# read, or the reverse, multiplies scores or values by 4-8: far off).
SCALES = {  # layer: (k_scale, v_scale)
    0: (0.125, 0.25),
    1: (0.25, 0.125),
    2: (0.125, 0.125),
}


def _with_kv_scales(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> str:
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors")
    return str(dst)


def _scale_tensors():
    (k0, v0), (k1, v1), (kv2, _) = SCALES[0], SCALES[1], SCALES[2]
    return {
        "model.layers.0.self_attn.k_scale": torch.tensor(k0),
        "model.layers.0.self_attn.v_scale": torch.tensor(v0),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([k1]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([v1]),
        "model.layers.2.self_attn.kv_scale": torch.tensor(kv2),
    }


def test_checkpoint_kv_scales(tmp_path, caplog):
    plain = save_random_model(tmp_path / "plain", "llama")
    scaled = _with_kv_scales(plain, tmp_path / "scaled", _scale_tensors())
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 17, 40, 90)]

    unscaled = LLM(str(plain), kv_cache_dtype="fp8", num_kv_blocks=64)
    llm = LLM(scaled, kv_cache_dtype="fp8", num_kv_blocks=64)
    spec = llm.engine.runner.kv_spec
    assert spec.k_scales == tuple(SCALES[i][0] for i in range(3))
    assert spec.v_scales == tuple(SCALES[i][1] for i in range(3))
    want = unscaled.generate(prompts, params)
    outs = llm.generate(prompts, params)
    for a, b in zip(want, outs):
        assert a.output.token_ids == b.output.token_ids
        for i, t in enumerate(a.output.token_ids):
            assert abs(a.output.logprobs[i][t].logprob - b.output.logprobs[i][t].logprob) < 0.01

    # and the cache really holds value / scale: 8x (layer 0's K) the unscaled bytes
    def layer0_k(engine):
        return engine.runner.model.attention_layers()[0].k_cache.float().abs().max()

    assert layer0_k(llm.engine) == 8 * layer0_k(unscaled.engine)
    assert_all_blocks_free(llm)

    # with the KV in the model's dtype the scales are unused, and the log says so
    with caplog.at_level(logging.WARNING, logger="services.engine.model_runner"):
        auto = LLM(scaled, num_kv_blocks=64)
    assert auto.engine.runner.kv_spec.k_scales == ()
    assert "k_scale / v_scale for an FP8 KV cache; unused" in caplog.text


@pytest.mark.parametrize(
    "name,tensor,error",
    [
        # per-head scales (one per KV head) are not supported
        ("model.layers.0.self_attn.k_scale", torch.ones(2), "one KV-cache scale per layer"),
        ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), "positive and finite"),
        # FP8 attention math (quantized queries) is not what this engine does
        ("model.layers.0.self_attn.q_scale", torch.tensor(1.0), "unexpected weight"),
        ("model.layers.9.self_attn.k_scale", torch.tensor(1.0), "unexpected weight"),
    ],
    ids=["per_head", "zero", "q_scale", "no_such_layer"],
)
def test_bad_checkpoint_kv_scales_are_refused(tmp_path, name, tensor, error):
    plain = save_random_model(tmp_path / "plain", "llama")
    path = _with_kv_scales(plain, tmp_path / "bad", {name: tensor})
    with pytest.raises(ValueError, match=error):
        LLM(path, kv_cache_dtype="fp8", num_kv_blocks=8)


def test_kv_scale_names_vllm_reads():
    from services.models.kv_scales import kv_scale_name

    attn = "model.layers.3.self_attn"
    assert kv_scale_name(f"{attn}.k_scale") == (attn, ("k_scale",))
    assert kv_scale_name(f"{attn}.v_proj.output_scale") == (attn, ("v_scale",))
    assert kv_scale_name(f"{attn}.k_proj.k_scale") == (attn, ("k_scale",))  # ModelOpt
    assert kv_scale_name(f"{attn}.kv_scale") == (attn, ("k_scale", "v_scale"))
    for other in (f"{attn}.k_proj.weight_scale", f"{attn}.k_proj.v_scale", f"{attn}.q_scale"):
        assert kv_scale_name(other) is None
