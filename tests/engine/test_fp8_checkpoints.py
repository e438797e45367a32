"""FP8 weights load in the formats real checkpoints use and stay FP8 in memory:

- block-wise (quant_method "fp8", weight_block_size [128, 128], float8_e4m3fn weights
  with a float32 `weight_scale_inv` per block; Qwen3-*-FP8, DeepSeek-V3),
- compressed-tensors float-quantized (llm-compressor FP8_DYNAMIC: `weight_scale` per
  channel [N, 1] or per tensor [1], dynamic per-token activations, `ignore`),
- online: an unquantized checkpoint with quantization="fp8" (per-channel).

Each test writes a small random checkpoint in that exact on-disk format and compares
the engine with transformers running the same weights dequantized in fp32, with the
acceptance tests/engine/fp8_helpers.py states (logprobs within LOGPROB_TOL, greedy
tokens equal on at least 7 of 8 prompts, exact against the activation-quantized
emulation). compressed-tensors FP8_BLOCK: test_fp8_block_compressed_tensors.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.fp8_helpers import (
    BLOCK,
    DELETE,
    FP8,
    all_layers,
    assert_fp8_memory,
    compare,
    fake_quant_activations,
    fake_quant_experts,
    fp8_layers,
    is_proj,
    prompts,
    quantize_block,
    quantize_channel,
    quantize_tensor,
    random_llama,
    with_quant,
    write_checkpoints,
)
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, hf_logprobs


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory):
    # hidden 320 and o_proj / down_proj outputs of 320: partial blocks along N and K
    config, model = random_llama(hidden=320, heads=2, kv_heads=1, head_dim=128, inter=640)
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if is_proj(name):  # every Linear of the decoder layers
            q, scale, d = quantize_block(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
            deq[name] = d
        else:  # embeddings, norms, lm_head stay in full precision, as published
            tensors[name] = deq[name] = value
    qconf = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return write_checkpoints(tmp_path_factory.mktemp("block"), config, model, tensors, deq, qconf)


CT_IGNORED = "model.layers.1.mlp.down_proj"


def _ct_config(strategy: str) -> dict:
    """quantization_config as llm-compressor's FP8_DYNAMIC scheme saves it."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": True,
                    "group_size": None,
                    "num_bits": 8,
                    "observer": None,
                    "observer_kwargs": {},
                    "strategy": "token",
                    "symmetric": True,
                    "type": "float",
                },
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": None,
                    "num_bits": 8,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": strategy,
                    "symmetric": True,
                    "type": "float",
                },
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


@pytest.fixture(scope="module", params=["channel", "tensor"])
def compressed_tensors(request, tmp_path_factory):
    strategy = request.param
    config, model = random_llama(hidden=272, heads=4, kv_heads=2, head_dim=48, inter=336)
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if is_proj(name) and not name.startswith(CT_IGNORED):
            if strategy == "channel":  # bf16 scales, as checkpoints saved in bf16 have
                q, scale, d = quantize_channel(value, torch.bfloat16)
            else:
                q, scale, d = quantize_tensor(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            deq[name] = d
        else:
            tensors[name] = deq[name] = value
    root = tmp_path_factory.mktemp(f"ct-{strategy}")
    return strategy, *write_checkpoints(root, config, model, tensors, deq, _ct_config(strategy))


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory):
    config, model = random_llama(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=384)
    state = model.state_dict()
    deq = {n: quantize_channel(v)[2] if is_proj(n) else v for n, v in state.items()}
    return write_checkpoints(tmp_path_factory.mktemp("online"), config, model, state, deq, None)


def test_block_fp8_checkpoint_stays_fp8_and_tracks_transformers(block_fp8):
    qdir, reference = block_fp8
    llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=128)
    wide = assert_fp8_memory(llm, all_layers(), "block")
    assert wide == []
    qkv = fp8_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    assert tuple(qkv.weight_scale.shape) == (4, 3)  # 512 rows, 320 columns in 128-blocks
    compare(llm, reference, group=BLOCK)


def test_compressed_tensors_fp8_dynamic_stays_fp8_and_tracks_transformers(compressed_tensors):
    strategy, qdir, reference = compressed_tensors
    llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=128)
    # fused layers keep a per-tensor checkpoint's shard scales per row (exact)
    wide = assert_fp8_memory(
        llm,
        all_layers(skip=[CT_IGNORED]),
        "channel" if strategy == "channel" else "channel|tensor",
    )
    assert wide == [f"{CT_IGNORED}.weight"]  # honoured `ignore`: kept in full precision
    if strategy == "tensor":
        assert fp8_layers(llm)["model.layers.0.self_attn.o_proj"].fp8_format.granularity == "tensor"
    compare(llm, reference, group=None, skip=[CT_IGNORED])


def test_online_fp8_quantization_of_an_unquantized_checkpoint(unquantized):
    qdir, reference = unquantized
    llm = LLM(str(qdir), kernel_backend="torch", quantization="fp8", max_num_batched_tokens=128)
    assert assert_fp8_memory(llm, all_layers(), "channel") == []
    compare(llm, reference, group=None)


def test_block_fp8_on_the_default_cpu_kernels_tracks_transformers(block_fp8):
    """The default backend on a CPU (tuned: the C small ops where they won) with FP8
    weights: the same tracking of transformers, without the exact emulation."""
    qdir, reference = block_fp8
    llm = LLM(str(qdir), max_num_batched_tokens=128)
    assert llm.engine.runner.ops.name == "tuned"
    compare(llm, reference, group=BLOCK, exact=False)


def test_dummy_weights_with_an_fp8_config_are_fp8(block_fp8):
    qdir, _ = block_fp8
    llm = LLM(str(qdir), load_format="dummy", num_kv_blocks=16)
    layers = fp8_layers(llm)
    assert set(layers) == all_layers()
    w = next(iter(layers.values()))
    assert w.weight.dtype == FP8 and torch.isfinite(w.weight.float()).all()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].output.token_ids) == 3


def test_fp8_checkpoint_faults_are_refused(block_fp8, tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = block_fp8

    def broken(label, edit):
        path = shutil.copytree(qdir, tmp_path / label)
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors")
        return str(path)

    # a weight without its scale
    path = broken("no-scale", lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match="lacks weights or FP8 scales.*down_proj.weight_scale"):
        LLM(path, num_kv_blocks=8)
    # a scale of the wrong shape
    path = broken(
        "bad-scale",
        lambda t: t.__setitem__(
            "model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(1, 1)
        ),
    )
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv: shape \(1, 1\)"):
        LLM(path, num_kv_blocks=8)
    # a full-precision weight where the config says FP8
    path = broken(
        "bf16-weight",
        lambda t: t.__setitem__(
            "model.layers.0.mlp.up_proj.weight", t["model.layers.0.mlp.up_proj.weight"].float()
        ),
    )
    with pytest.raises(ValueError, match="up_proj.weight: .*holds torch.float32"):
        LLM(path, num_kv_blocks=8)


@pytest.mark.parametrize(
    "edits, message",
    [
        (
            {"config_groups__group_0__input_activations__dynamic": False},
            r"config_groups.group_0.input_activations.dynamic = False .*supported: True",
        ),
        (
            {"config_groups__group_0__weights__type": "int"},
            r"config_groups.group_0.weights.type = 'int'",
        ),
        (
            {"config_groups__group_0__weights__strategy": "group"},
            r"weights.strategy = 'group' .*'channel', 'tensor'",
        ),
        (
            {"config_groups__group_0__input_activations": None},
            r"input_activations = None .*dynamic per-token",
        ),
        ({"format": "pack-quantized"}, r"quantization_config.format = 'pack-quantized'"),
        (
            {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"}},
            r"kv_cache_scheme.strategy = 'channel'",
        ),
        ({"transform_config": {"x": 1}}, r"quantization_config.transform_config .*absent"),
    ],
)
def test_unsupported_compressed_tensors_configs_are_refused_naming_the_key(
    ct_config_only, edits, message, tmp_path
):
    with pytest.raises(ValueError, match=message):
        LLM(with_quant(ct_config_only, tmp_path / "c", **edits), num_kv_blocks=8)


@pytest.fixture(scope="module")
def ct_config_only(unquantized, tmp_path_factory):
    """A compressed-tensors config.json (refused before any tensor is read)."""
    path = shutil.copytree(unquantized[0], tmp_path_factory.mktemp("ct-config") / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = _ct_config("channel")
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_quantization_argument_is_validated(block_fp8, ct_config_only, tmp_path):
    ct_dir = ct_config_only
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(ct_dir), quantization="int8", num_kv_blocks=8)
    with pytest.raises(ValueError, match="already quantized.*compressed-tensors"):
        LLM(str(ct_dir), quantization="fp8", num_kv_blocks=8)
    # per-tensor fp8 (no weight_block_size) is not supported: said at start, listing all
    qdir, _ = block_fp8
    other = with_quant(qdir, tmp_path / "per-tensor", weight_block_size=DELETE)
    with pytest.raises(
        ValueError, match="'fp8' without weight_block_size.*supported: unquantized.*compressed"
    ):
        LLM(other, num_kv_blocks=8)


def test_compressed_tensors_fp8_moe_keeps_experts_fp8(tmp_path, caplog):
    """A compressed-tensors FP8 Qwen3-MoE (every expert stored in FP8 with its
    per-channel `weight_scale` [N, 1], the router ignored as published configs do):
    attention, the dense MLP and the experts stay FP8 (the experts' scales one per row
    of w13 / w2), and the model computes what transformers computes on those weights
    with the same activation quantization, the experts' included."""
    from safetensors.torch import load_file, save_file

    from tests.engine.helpers import save_random_moe_model

    src = save_random_moe_model(tmp_path / "moe", "qwen3_moe")
    tensors, deq = {}, {}
    for name, value in load_file(src / "model.safetensors").items():
        if is_proj(name):  # attention, the dense layer's MLP and every expert
            q, scale, d = quantize_channel(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            deq[name] = d
        else:
            tensors[name] = deq[name] = value
    qconf = _ct_config("channel")
    qconf["ignore"] = ["lm_head", "re:.*mlp\\.gate$"]
    qdir = shutil.copytree(src, tmp_path / "q")
    raw = json.loads((qdir / "config.json").read_text())
    raw["quantization_config"] = qconf
    (qdir / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tensors.items()}, qdir / "model.safetensors")
    ref = shutil.copytree(src, tmp_path / "ref")
    save_file({k: v.contiguous() for k, v in deq.items()}, ref / "model.safetensors")

    with caplog.at_level("INFO"):
        # the torch kernels, as the other exact comparisons here: the tuned backend's
        # choice varies with timing, and a last-bit difference in a norm or attention can
        # move an activation across an e4m3 rounding boundary (a logprob off by ~0.02)
        llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=64)
    assert "keep their experts in FP8" in caplog.text
    assert "dequantized at load" not in caplog.text
    layers = fp8_layers(llm)
    assert "model.layers.1.mlp.gate_up_proj" in layers  # layer 1 is dense (mlp_only_layers)
    assert "model.layers.0.self_attn.qkv_proj" in layers
    model = llm.engine.runner.model
    moe = model.model.layers[0].mlp
    inter = moe.intermediate_size
    assert type(moe.gate).__name__ == "Linear" and moe.gate.weight.dtype == torch.float32
    assert moe.w13.dtype == FP8 and moe.w13_scale.shape == (8, 2 * inter)
    up3 = "model.layers.0.mlp.experts.3.up_proj."
    assert torch.equal(
        moe.w13[3, inter:].view(torch.uint8), tensors[up3 + "weight"].view(torch.uint8)
    )
    assert torch.equal(moe.w13_scale[3, inter:], tensors[up3 + "weight_scale"].reshape(-1))
    down5 = "model.layers.0.mlp.experts.5.down_proj.weight_scale"
    assert torch.equal(moe.w2_scale[5], tensors[down5].reshape(-1))
    emulated = fake_quant_activations(hf_load(ref), None)
    fake_quant_experts(emulated, None)
    few = prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
    for prompt, out in zip(few, llm.generate(few, params)):
        tokens = out.output.token_ids
        assert tokens == hf_greedy(emulated, prompt, 4, ignore_eos=True)
        ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            assert entry[token].logprob == pytest.approx(ref_lp[pos, token].item(), abs=1e-3)
    assert_all_blocks_free(llm)
