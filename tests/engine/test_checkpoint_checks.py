"""Config keys the engine cannot honour are refused at start, by name, instead of
being computed differently: a quantization_config that is not a supported FP8 format
(AWQ, GPTQ, per-tensor fp8, ...), a sliding window where transformers' model of the
family has none (or layer_types it cannot place), and an MLP activation other than SiLU.
A sliding window the family does apply is honoured (test_sliding_window.py)."""

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


def test_a_sliding_window_is_honoured_past_the_window(tmp_path):
    # Mistral slides on every layer: served at its full length, and the output follows
    # full attention's until the first query at position >= window, then departs
    windowed = save_random_model(tmp_path / "sw", "mistral", sliding_window=8)
    full = save_random_model(tmp_path / "full", "mistral")  # same weights, no window
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    llm = LLM(str(windowed), num_kv_blocks=8)
    assert llm.engine.max_model_len == 128  # the KV capacity, not the window
    win = llm.generate(prompt, params)[0].output.token_ids
    ref = LLM(str(full), num_kv_blocks=8).generate(prompt, params)[0].output.token_ids
    assert win[:5] == ref[:5]  # made by queries at positions 3..7 < 8
    assert win != ref
    # a window beyond every position (max_position_embeddings is 1024) never binds: the
    # layers run as full attention
    wide = _with_config(windowed, sliding_window=4096)
    attn = LLM(wide, num_kv_blocks=8).engine.runner.model.attention_layers()
    assert [a.sliding_window for a in attn] == [None] * 3


def test_a_sliding_window_the_family_ignores_is_refused_past_it(model_dir, tmp_path):
    import shutil

    # transformers' Llama has no window; the weights may expect one: refused where the
    # two would differ, served within it
    copy = shutil.copytree(model_dir, tmp_path / "sw")
    model = _with_config(copy, sliding_window=64)  # max_position_embeddings is 1024
    with pytest.raises(ValueError, match="sliding_window=64.*'llama'.*--max-model-len 64"):
        LLM(model, num_kv_blocks=8)
    llm = LLM(model, num_kv_blocks=8, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].output.token_ids) == 4
    # a window that is switched off (Qwen's use_sliding_window) changes nothing
    off = _with_config(
        shutil.copytree(model_dir, tmp_path / "off"), sliding_window=64, use_sliding_window=False
    )
    assert LLM(off, num_kv_blocks=8).engine.max_model_len == 128  # the KV capacity


def test_windows_that_cannot_be_placed_are_refused_naming_the_key():
    from transformers import MistralConfig, Qwen2Config

    from services.models.loader import check_supported

    qwen2 = Qwen2Config(
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["chunked_attention", "sliding_attention"],
    )
    with pytest.raises(ValueError, match="layer_types=.*'chunked_attention'"):
        check_supported(qwen2, 1024)
    with pytest.raises(ValueError, match="sliding_window=-3 .*positive integer"):
        check_supported(MistralConfig(num_hidden_layers=2, sliding_window=-3), 1024)


def test_an_activation_other_than_silu_is_refused_naming_it(model_dir, tmp_path):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "act")
    model = _with_config(copy, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh'.*silu only"):
        LLM(model, num_kv_blocks=8)
