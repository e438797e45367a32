"""compressed-tensors block FP8, as llm-compressor's FP8_BLOCK scheme saves it
(RedHatAI/*-FP8-block and the like): config_groups with `weights: {strategy: "block",
block_structure: [128, 128], dynamic: false}` and `input_activations: {strategy:
"group", group_size: 128, dynamic: true}`, float8_e4m3fn `<layer>.weight` and one
`<layer>.weight_scale` per 128 x 128 block ([ceil(N/128), ceil(K/128)], in the
model's dtype: bf16 here, as bf16 models are published).

It loads onto the same block-scaled layers as `weight_scale_inv` checkpoints and is
held to the same acceptance against transformers on the dequantized fp32 weights
(tests/engine/fp8_helpers.py): logprobs within LOGPROB_TOL, greedy tokens equal on at
least 7 of 8 prompts, exact against the activation-quantized emulation. Weights that
the compressed-tensors releases which padded partial blocks stored padded, with a
`weight_shape_original`, load to the same layers; what the kernels cannot run is
refused at start, naming the config key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine import LLM, SamplingParams
from tests.engine.fp8_helpers import (
    BLOCK,
    DELETE,
    all_layers,
    assert_fp8_memory,
    compare,
    fp8_layers,
    is_proj,
    prompts,
    quantize_block,
    random_llama,
    with_quant,
    write_checkpoints,
)
from tests.engine.helpers import assert_all_blocks_free

IGNORED = "model.layers.1.mlp.down_proj"
GROUP = "config_groups__group_0__"


def fp8_block_config() -> dict:
    """quantization_config as compressed-tensors serializes llm-compressor's FP8_BLOCK
    preset (every QuantizationArgs field written out)."""
    args = dict(
        actorder=None,
        num_bits=8,
        observer_kwargs={},
        scale_dtype=None,
        symmetric=True,
        type="float",
        zp_dtype=None,
    )
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": dict(
                    args,
                    block_structure=None,
                    dynamic=True,
                    group_size=BLOCK,
                    observer=None,
                    strategy="group",
                ),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": dict(
                    args,
                    block_structure=[BLOCK, BLOCK],
                    dynamic=False,
                    group_size=None,
                    observer="memoryless_minmax",
                    strategy="block",
                ),
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def _quantized(model):
    """(checkpoint tensors, dequantized fp32 state dict, bf16 block scales by layer)."""
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if is_proj(name) and not name.startswith(IGNORED):
            q, scale, d = quantize_block(value, torch.bfloat16)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            deq[name] = d
        else:  # embeddings, norms, lm_head and the ignored layer stay full precision
            tensors[name] = deq[name] = value
    return tensors, deq


@pytest.fixture(scope="module")
def ct_block(tmp_path_factory):
    # hidden 320, o_proj / down_proj outputs of 320: partial blocks along N and K
    config, model = random_llama(hidden=320, heads=2, kv_heads=1, head_dim=128, inter=640)
    tensors, deq = _quantized(model)
    root = tmp_path_factory.mktemp("ct-block")
    return write_checkpoints(root, config, model, tensors, deq, fp8_block_config())


def test_fp8_block_checkpoint_stays_fp8_and_tracks_transformers(ct_block):
    qdir, reference = ct_block
    llm = LLM(str(qdir), kernel_backend="torch", max_num_batched_tokens=128)
    wide = assert_fp8_memory(llm, all_layers(skip=[IGNORED]), "block")
    assert wide == [f"{IGNORED}.weight"]  # honoured `ignore`: kept in full precision
    layers = fp8_layers(llm)
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.fp8_format.block_n, qkv.fp8_format.block_k) == (BLOCK, BLOCK)
    assert tuple(qkv.weight_scale.shape) == (4, 3)  # 512 rows, 320 columns in 128-blocks
    assert qkv.weight_scale.dtype == torch.float32  # the bf16 scales, exactly
    saved = load_file(qdir / "model.safetensors")
    o_scale = saved["model.layers.1.self_attn.o_proj.weight_scale"]
    assert o_scale.dtype == torch.bfloat16
    assert torch.equal(layers["model.layers.1.self_attn.o_proj"].weight_scale, o_scale.float())
    compare(llm, reference, group=BLOCK, skip=[IGNORED])


def test_padded_weights_with_their_original_shape_load_the_same(ct_block, tmp_path):
    """The releases that padded partial blocks stored the padded weight (zeros quantize
    to zeros) and its true [rows, columns] as `<layer>.weight_shape_original` (int64)."""
    qdir, _ = ct_block
    tensors = load_file(qdir / "model.safetensors")
    padded_layers = 0
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name.removesuffix("_scale")
        w = tensors[base]
        rows, cols = -(-w.shape[0] // BLOCK) * BLOCK, -(-w.shape[1] // BLOCK) * BLOCK
        if (rows, cols) != tuple(w.shape):
            full = torch.zeros(rows, cols, dtype=w.dtype)
            full[: w.shape[0], : w.shape[1]] = w
            tensors[base] = full
            tensors[base + "_shape_original"] = torch.tensor(list(w.shape), dtype=torch.int64)
            padded_layers += 1
    assert padded_layers >= 4  # every o_proj, and gate / up / qkv along K
    path = shutil.copytree(qdir, tmp_path / "padded")
    save_file(tensors, path / "model.safetensors")
    want = fp8_layers(LLM(str(qdir), num_kv_blocks=8))
    got = fp8_layers(LLM(str(path), num_kv_blocks=8))
    assert set(got) == set(want)
    for name, layer in got.items():
        assert torch.equal(layer.weight.view(torch.uint8), want[name].weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, want[name].weight_scale)
    # a true shape that does not fit the stored weight is refused by name
    bad = "model.layers.0.self_attn.o_proj.weight_shape_original"
    tensors[bad] = torch.tensor([384, 320], dtype=torch.int64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{bad}: \[384, 320\] does not fit"):
        LLM(str(path), num_kv_blocks=8)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A random Llama folder with the FP8_BLOCK config.json: refusals come before any
    tensor is read."""
    config, model = random_llama(hidden=256, heads=2, kv_heads=2, head_dim=128, inter=256)
    root = tmp_path_factory.mktemp("ct-block-config")
    state = model.state_dict()
    qdir, _ = write_checkpoints(root, config, model, state, state, fp8_block_config())
    return qdir


@pytest.mark.parametrize(
    "edits, message",
    [
        (  # the GEMMs walk K in power-of-two tiles inside one scale block
            {GROUP + "weights__block_structure": [128, 96]},
            r"weights.block_structure \[128, 96\] .*not supported.*power of two",
        ),
        (
            {GROUP + "weights__block_structure": [128]},
            r"weights.block_structure \[128\] .*\[n, k\]",
        ),
        ({GROUP + "weights__block_structure": None}, r"weights.block_structure None .*\[n, k\]"),
        (  # activation groups other than the weight's K blocks
            {GROUP + "input_activations__group_size": 64},
            r"input_activations.group_size = 64 .*supported: 128",
        ),
        (  # static activation scales
            {GROUP + "input_activations__dynamic": False},
            r"input_activations.dynamic = False .*supported: True",
        ),
        (
            {
                GROUP + "input_activations__strategy": "token",
                GROUP + "input_activations__group_size": None,
            },
            r"input_activations.strategy = 'token' .*'group' with block weights",
        ),
        ({GROUP + "input_activations": None}, r"input_activations = None .*per-group"),
        ({GROUP + "weights__symmetric": False}, r"weights.symmetric = False"),
        ({GROUP + "weights__num_bits": 4}, r"weights.num_bits = 4"),
        ({GROUP + "weights__actorder": "group"}, r"weights.actorder = 'group' .*null"),
        ({GROUP + "weights__group_size": 128}, r"weights.group_size = 128 .*null"),
        (
            {GROUP + "input_activations__block_structure": [1, 128]},
            r"input_activations.block_structure = \[1, 128\]",
        ),
        ({GROUP + "weights__future_field": "x"}, r"weights.future_field = 'x' .*absent"),
        ({GROUP + "transform": {"x": 1}}, r"config_groups.group_0.transform = .*absent"),
    ],
)
def test_unsupported_fp8_block_configs_are_refused_naming_the_key(
    config_only, edits, message, tmp_path
):
    with pytest.raises(ValueError, match=message):
        LLM(with_quant(config_only, tmp_path / "c", **edits), num_kv_blocks=8)


def test_fields_a_config_may_leave_out_take_their_defaults(config_only, tmp_path):
    # compressed-tensors' defaults: symmetric, static weights; the older "128x128"
    # spelling of block_structure
    edits = {
        GROUP + "weights__symmetric": DELETE,
        GROUP + "weights__dynamic": DELETE,
        GROUP + "weights__block_structure": "128x128",
    }
    llm = LLM(with_quant(config_only, tmp_path / "c", **edits), load_format="dummy")
    layer = fp8_layers(llm)["model.layers.0.mlp.down_proj"]
    assert (layer.fp8_format.block_n, layer.fp8_format.block_k) == (128, 128)


def test_a_fused_shard_inside_a_scale_block_is_refused_naming_block_structure(tmp_path):
    # q rows 3 x 48 = 144: k_proj would start inside the second 128-row scale block
    config, model = random_llama(hidden=288, heads=3, kv_heads=1, head_dim=48, inter=256)
    state = model.state_dict()
    qdir, _ = write_checkpoints(tmp_path, config, model, state, state, fp8_block_config())
    with pytest.raises(
        ValueError,
        match=r"config_groups.group_0.weights.block_structure \[128, 128\]: .*k_proj starts "
        "at row 144",
    ):
        LLM(str(qdir), load_format="dummy")


def test_block_fp8_weight_block_size_the_kernels_cannot_run_is_refused(config_only, tmp_path):
    path = shutil.copytree(config_only, tmp_path / "fp8")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 100],
    }
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 100\] .*power of two"):
        LLM(str(path), num_kv_blocks=8)


@pytest.fixture(scope="module")
def aligned_ct_block(tmp_path_factory):
    # every TP=2 split falls on a 128 block: q / kv rows 128, MLP width 256 per rank
    config, model = random_llama(hidden=256, heads=2, kv_heads=2, head_dim=128, inter=512)
    tensors, deq = _quantized(model)
    root = tmp_path_factory.mktemp("ct-block-aligned")
    return write_checkpoints(root, config, model, tensors, deq, fp8_block_config())


def test_fp8_block_tp2_equals_tp1(aligned_ct_block):
    """Each rank takes its rows (column-parallel) or K blocks (row-parallel) of the
    weights and their block scales, as for weight_scale_inv checkpoints: the same
    128-wide activation groups, so only fp32 summation order differs. Both on the torch
    kernels: the tuned backend's picks vary with timing from one engine to the next,
    and FP8 activation quantization turns a last-bit difference into a larger one."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        with LLM(str(aligned_ct_block[0]), tensor_parallel_size=tp, kernel_backend="torch") as llm:
            runs.append(llm.generate(prompts(), params))
            assert_all_blocks_free(llm)
    for a, b in zip(*runs, strict=True):
        assert a.output.token_ids == b.output.token_ids
        for x, y, t in zip(a.output.logprobs, b.output.logprobs, a.output.token_ids):
            assert abs(x[t].logprob - y[t].logprob) < 1e-3
