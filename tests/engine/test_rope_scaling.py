"""RoPE scalings as checkpoints ship them: the tables equal transformers' own
(inverse frequencies bit for bit, YaRN's attention factor exactly), a Qwen2 model with
YaRN switched on the way Qwen's model cards say (config.json `rope_scaling`) equals
transformers token for token past its pretraining length, the default context grows
with the scaling, and what the tables cannot express is refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.models.rope import (
    attention_scaling,
    inverse_frequencies,
    max_positions,
    rope_parameters,
)
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, save_random_model

SCALINGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "truncate": False,
    },
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "beta_fast": 16},
    {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
        "attention_factor": 1.3,
    },
    # DeepSeek-V3's: mscale over mscale_all_dim
    {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
]


def _config(scaling: dict, theta: float = 1e6, max_position: int = 1024):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=128,
        num_attention_heads=8,
        max_position_embeddings=max_position,
        rope_parameters={"rope_theta": theta, **scaling},
    )


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_tables_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config(dict(scaling))
    kind = scaling["rope_type"]
    init = ROPE_INIT_FUNCTIONS[kind] if kind != "default" else None
    if init is None:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        want, factor = Qwen2RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        want, factor = init(config, "cpu")
    params = rope_parameters(config)
    assert torch.equal(inverse_frequencies(16, params), want)
    assert attention_scaling(params) == factor


def test_the_default_context_grows_with_the_scaling():
    # Qwen2.5's model card: 32k pretrained, YaRN x4 for 128k
    qwen = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert max_positions(_config(qwen, max_position=32768)) == 131072
    assert max_positions(_config({"rope_type": "linear", "factor": 2.0})) == 2048
    assert max_positions(_config({"rope_type": "default"})) == 1024
    # a config that already states the longer length keeps it
    assert max_positions(_config(dict(qwen, original_max_position_embeddings=64))) == 1024


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'.*supported: default"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            "rope_type 'longrope'",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_what_the_tables_cannot_express_is_refused(keys, message):
    with pytest.raises(ValueError, match=message):
        rope_parameters(_config(keys))


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    """A random Qwen2 with YaRN switched on as Qwen's model cards say: a `rope_scaling`
    entry added to config.json (the 4.x key, `type` not `rope_type`), here with a
    pretraining length of 64 so that the prompts run far past it."""
    path = save_random_model(tmp_path_factory.mktemp("qwen2-yarn"), "qwen2")
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 1e6
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_yarn_model_matches_transformers_past_its_pretraining_length(yarn_model):
    hf = hf_load(yarn_model)
    assert hf.model.rotary_emb.attention_scaling > 1  # the reference really scales
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 70, 150, 230)]
    llm = LLM(str(yarn_model), block_size=16, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.output.token_ids == hf_greedy(hf, prompt, 24, ignore_eos=True)
    assert_all_blocks_free(llm)
    # and the scaling shows: without it the long prompts continue otherwise
    plain = yarn_model.parent / "plain"
    config = json.loads((yarn_model / "config.json").read_text())
    del config["rope_scaling"]
    plain.mkdir()
    for f in yarn_model.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "config.json").write_text(json.dumps(config))
    unscaled = LLM(str(plain), block_size=16, max_num_batched_tokens=128).generate(prompts, params)
    assert [o.output.token_ids for o in unscaled[1:]] != [o.output.token_ids for o in outs[1:]]
