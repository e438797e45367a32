"""Config keys the engine cannot honour are refused at start, by name, instead of
being computed differently: a quantization_config that is not a supported FP8 format
(AWQ, GPTQ, per-tensor fp8, ...), a sliding window
shorter than the sequences it would have to cover, and an MLP activation other than SiLU."""

from __future__ import annotations

import json

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import save_random_model


def _with_config(path, **keys):
    config = json.loads((path / "config.json").read_text())
    config.update(keys)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize(
    "method, message",
    [
        ("fp8", "quant_method 'fp8' without weight_block_size.*supported: unquantized"),
        ("awq", "quant_method 'awq'.*supported: unquantized.*fp8.*compressed-tensors"),
        ("gptq", "quant_method 'gptq'.*supported: unquantized"),
        # a supported method with keys it does not hold: the first missing key is named
        ("compressed-tensors", "quantization_config.format = None"),
    ],
)
def test_an_unsupported_quantized_checkpoint_is_refused_naming_it(
    model_dir, method, message, tmp_path
):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "q")
    model = _with_config(copy, quantization_config={"quant_method": method, "bits": 8})
    with pytest.raises(ValueError, match=message):
        LLM(model, num_kv_blocks=8)


def test_sliding_window_needs_max_model_len_within_it(model_dir, tmp_path):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "sw")
    model = _with_config(copy, sliding_window=64)  # max_position_embeddings is 1024
    with pytest.raises(ValueError, match="sliding_window=64.*--max-model-len 64"):
        LLM(model, num_kv_blocks=8)
    # within the window full attention is the model's own: served
    llm = LLM(model, num_kv_blocks=8, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].output.token_ids) == 4
    # a window that is switched off (Qwen's use_sliding_window) changes nothing
    off = _with_config(
        shutil.copytree(model_dir, tmp_path / "off"), sliding_window=64, use_sliding_window=False
    )
    assert LLM(off, num_kv_blocks=8).engine.max_model_len == 128  # the KV capacity


def test_an_activation_other_than_silu_is_refused_naming_it(model_dir, tmp_path):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "act")
    model = _with_config(copy, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh'.*silu only"):
        LLM(model, num_kv_blocks=8)
