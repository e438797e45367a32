"""The engine with PDSERVE_TRITON_FP8_PREQUANT=1 (each norm before an FP8 GEMV, where
the norm is not folded into it, quantizes the row once: norm_quant.py) or =gated (only
the norm before a gated gate_up) against the same
engine with every GEMV program quantizing the row itself: the same tokens and logprobs,
bit for bit under Triton's interpreter, and the quantizing norm really ran. A block-FP8
checkpoint (test_fp8_checkpoints.py's: qkv and gated gate_up) and online per-channel FP8."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

from services.engine import LLM, SamplingParams  # noqa: E402
from tests.engine.helpers import assert_all_blocks_free, save_random_model  # noqa: E402
from tests.engine.test_fp8_checkpoints import block_fp8  # noqa: E402, F401 - a fixture

PROMPT = [5, 9, 200, 31, 77, 12]  # one sequence: every decode step is one row
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory, block_fp8):  # noqa: F811 - the fixture imported above
    # block_fp8: hidden 320, 128 x 128 scales, partial blocks along N and K
    llama = save_random_model(tmp_path_factory.mktemp("norm_quant") / "llama", "llama")
    return {"block": (block_fp8[0], None), "online": (llama, "fp8")}


def _generate(model, device, monkeypatch, prequant: str):
    path, quantization = model
    monkeypatch.setenv("PDSERVE_TRITON_NORM_FOLD", "0")  # the interpreter would fold them all
    monkeypatch.setenv("PDSERVE_TRITON_FP8_PREQUANT", prequant)
    llm = LLM(
        str(path), device=device, dtype="float32", block_size=16, num_kv_blocks=16,
        max_model_len=64, kernel_backend="triton", quantization=quantization,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params)[0].output
    assert_all_blocks_free(llm)
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("mode", ["1", "gated"])
@pytest.mark.parametrize("kind", ["block", "online"], ids=["block-fp8", "online-channel-fp8"])
def test_the_prequantizing_engine_equals_the_plain_one(
    kind, mode, models, device, monkeypatch, quant_calls
):
    off = _generate(models[kind], device, monkeypatch, "0")
    assert quant_calls == {"plain": 0, "gated": 0}
    on = _generate(models[kind], device, monkeypatch, mode)
    assert on == off
    layers = json.loads((models[kind][0] / "config.json").read_text())["num_hidden_layers"]
    # each decode step: every layer's gate_up (gated), and with "1" every qkv but the
    # first layer's too (no residual yet: a plain RMSNorm)
    plain = (layers - 1) * DECODE_STEPS if mode == "1" else 0
    assert quant_calls == {"plain": plain, "gated": layers * DECODE_STEPS}


def test_a_mistyped_prequant_switch_is_refused(monkeypatch):
    from services.kernels.triton_backend import TritonBackend

    monkeypatch.setenv("PDSERVE_TRITON_FP8_PREQUANT", "yes")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_FP8_PREQUANT"):
        TritonBackend()
    assert TritonBackend(fp8_prequant="gated").fp8_prequant == "gated"  # an explicit choice wins
    monkeypatch.delenv("PDSERVE_TRITON_FP8_PREQUANT")
    assert TritonBackend().fp8_prequant is None  # unset: each call's tuned mode, else "0"
    with pytest.raises(ValueError, match="fp8_prequant"):
        TritonBackend(fp8_prequant=True)
