"""The engine with each layer's RMSNorm folded into the linear after it (the triton
backend's add_rms_norm_linear on one decode row: qkv and gate_up, a MoE's router, FP8
linears) against the same engine with the norm as its own kernel: the same tokens and
logprobs, and the fold really ran. On a CPU the kernels run under Triton's interpreter,
where the fold is bit-exact, so equality is exact."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

from services.engine import LLM, SamplingParams  # noqa: E402
from tests.engine.helpers import (  # noqa: E402
    assert_all_blocks_free,
    save_random_model,
    save_random_moe_model,
)

PROMPT = [5, 9, 200, 31, 77, 12]  # one sequence: every decode step is one row


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("norm_fold")
    return {
        "llama": save_random_model(root / "llama", "llama"),
        "qwen3_moe": save_random_moe_model(root / "qwen3_moe", "qwen3_moe"),
    }


@pytest.fixture
def fold_calls(monkeypatch):
    """How many times each fold ran (the real kernels, counted)."""
    from services.kernels.triton import fp8_gemv, norm_fold

    calls = {"bf16": 0, "fp8": 0}

    def counted(kind, fn):
        def run(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(
        norm_fold, "add_rms_norm_gemv", counted("bf16", norm_fold.add_rms_norm_gemv)
    )
    monkeypatch.setattr(
        fp8_gemv, "add_rms_norm_fp8_gemv", counted("fp8", fp8_gemv.add_rms_norm_fp8_gemv)
    )
    return calls


def _folds(model_dir) -> int:
    """Norms folded in a run: two a layer but the first layer's input norm (no residual
    yet), each decode step after the prompt's (4 steps)."""
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return (2 * layers - 1) * 4


def _generate(model_dir, device, monkeypatch, fold: str, prompts=(PROMPT,), **engine_args):
    monkeypatch.setenv("PDSERVE_TRITON_NORM_FOLD", fold)
    llm = LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        block_size=16,
        num_kv_blocks=16,
        max_model_len=64,
        **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    outs = [r.output for r in llm.generate(list(prompts), params)]
    assert_all_blocks_free(llm)
    if len(outs) == 1:
        return outs[0].token_ids, outs[0].logprobs
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize(
    "model,quantization",
    [("llama", None), ("llama", "fp8"), ("qwen3_moe", None)],
    ids=["llama", "llama-fp8", "qwen3-moe"],
)
def test_the_folded_engine_equals_the_unfolded(
    model, quantization, models, device, monkeypatch, fold_calls
):
    args = dict(kernel_backend="triton", quantization=quantization)
    off = _generate(models[model], device, monkeypatch, "0", **args)
    assert fold_calls == {"bf16": 0, "fp8": 0}  # off: every norm its own kernel
    on = _generate(models[model], device, monkeypatch, "1", **args)
    assert on == off
    kind = "fp8" if quantization else "bf16"
    assert fold_calls[kind] == _folds(models[model])
    assert fold_calls["bf16" if quantization else "fp8"] == 0


def test_the_tuned_backend_folds_only_where_one_backend_won_both(
    models, device, monkeypatch, fold_calls, tmp_path
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    common = "rms_norm=torch,rotary_embedding=torch,silu_and_mul=torch,store_kv_cache=triton,"
    common += "paged_attention=triton"
    ref = _generate(models["llama"], device, monkeypatch, "0", kernel_backend="torch")
    split = f"{common},linear=torch,linear.decode1=triton,fused_add_rms_norm=torch"
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=split
    )
    assert fold_calls["bf16"] == 0  # the norm's winner is another backend: no fold
    assert got[0] == ref[0]
    same = f"{split},fused_add_rms_norm.decode1=triton"  # one decode row: triton won both
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=same
    )
    assert fold_calls["bf16"] == _folds(models["llama"])  # triton won both: its fold
    assert got[0] == ref[0]


def test_a_mistyped_switch_is_refused(monkeypatch):
    from services.kernels.triton_backend import TritonBackend

    monkeypatch.setenv("PDSERVE_TRITON_NORM_FOLD", "yes")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_NORM_FOLD"):
        TritonBackend()
    assert TritonBackend(norm_fold=False).norm_fold is False  # an explicit choice wins


@pytest.fixture
def gated_calls(monkeypatch):
    """How many gate_up GEMVs applied the SiLU themselves (the real kernels, counted)."""
    from services.kernels.triton import fp8_gemv, gated_gemv, norm_fold

    calls = {"alone": 0, "with the norm": 0}

    def counted(module, name, kind, needs_flag):
        fn = getattr(module, name)

        def run(*args, **kwargs):
            if not needs_flag or kwargs.get("gated"):
                calls[kind] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    counted(gated_gemv, "gemv_silu_and_mul", "alone", False)
    counted(gated_gemv, "fp8_gemv_silu_and_mul", "alone", False)
    counted(norm_fold, "add_rms_norm_gemv", "with the norm", True)
    counted(fp8_gemv, "add_rms_norm_fp8_gemv", "with the norm", True)
    return calls


@pytest.mark.parametrize("fold", ["0", "1"], ids=["norm-apart", "norm-folded"])
@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["fp32", "fp8"])
def test_the_gated_gemv_engine_equals_the_silu_kernel_engine(
    fold, quantization, models, device, monkeypatch, gated_calls
):
    args = dict(kernel_backend="triton", quantization=quantization)
    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "0")
    off = _generate(models["llama"], device, monkeypatch, fold, **args)
    assert gated_calls == {"alone": 0, "with the norm": 0}
    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "1")
    on = _generate(models["llama"], device, monkeypatch, fold, **args)
    assert on == off  # the same tokens and logprobs, bit for bit under the interpreter
    layers = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    decode = layers * 4  # every layer's gate_up, each of the 4 decode steps
    # the 6-token prefill: the plain GEMV takes up to 8 rows (unfolded), the FP8 one row
    prefill = 0 if quantization else layers
    want = {"alone": prefill, "with the norm": decode} if fold == "1" else {
        "alone": prefill + decode, "with the norm": 0}  # fmt: skip
    assert gated_calls == want


def test_three_decode_rows_gate_on_the_tensor_core_path(models, device, monkeypatch, gated_calls):
    prompts = (PROMPT, [7, 3, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9])  # every decode step: 3 rows
    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "0")
    off = _generate(models["llama"], device, monkeypatch, "1", prompts, kernel_backend="triton")
    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "1")
    on = _generate(models["llama"], device, monkeypatch, "1", prompts, kernel_backend="triton")
    assert on == off
    layers = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    assert gated_calls == {"alone": layers * 4, "with the norm": 0}  # no fold past one row


def test_a_mistyped_gated_switch_is_refused(monkeypatch):
    from services.kernels.triton_backend import TritonBackend

    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "on")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_GATED_GEMV"):
        TritonBackend()
    assert TritonBackend(gated_gemv=True).gated_gemv is True  # an explicit choice wins


def test_the_tuned_backend_gates_only_where_triton_won_the_silu_too(
    models, device, monkeypatch, gated_calls, tmp_path
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PDSERVE_TRITON_GATED_GEMV", "1")
    ref = _generate(models["llama"], device, monkeypatch, "0", kernel_backend="torch")
    split = "rms_norm=torch,rotary_embedding=torch,store_kv_cache=triton,paged_attention=triton,"
    split += "linear=torch,linear.decode1=triton,fused_add_rms_norm=torch,"
    split += "fused_add_rms_norm.decode1=triton,silu_and_mul=torch"
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=split
    )
    assert gated_calls == {"alone": 0, "with the norm": 0}  # the SiLU's winner is torch
    assert got[0] == ref[0]
    same = f"{split},silu_and_mul.decode1=triton"
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=same
    )
    layers = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    assert gated_calls["with the norm"] == layers * 4  # triton won all three: one launch
    assert got[0] == ref[0]
