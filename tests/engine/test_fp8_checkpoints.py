"""FP8 weights load in the formats real checkpoints use and stay FP8 in memory:

- block-wise (quant_method "fp8", weight_block_size [128, 128], float8_e4m3fn weights
  with a float32 `weight_scale_inv` per block; Qwen3-*-FP8, DeepSeek-V3),
- compressed-tensors float-quantized (llm-compressor FP8_DYNAMIC: `weight_scale` per
  channel [N, 1] or per tensor [1], dynamic per-token activations, `ignore`),
- online: an unquantized checkpoint with quantization="fp8" (per-channel).

Each test writes a small random checkpoint in that exact on-disk format and compares
the engine with transformers running the same weights dequantized in fp32. The engine
also quantizes activations (dynamically, per token / per 128-group), so that
comparison holds within a tolerance: every generated token's logprob within
LOGPROB_TOL nats of transformers' on the same tokens, and the 8 greedy tokens equal on
at least 7 of 8 prompts. Against transformers with the same activation quantization
applied to its Linear inputs (forward pre-hooks, written here independently) the
engine is exact up to fp32 summation order: tokens equal and logprobs within 1e-3.

The random models have unit-scale embeddings and LM head (clear logit margins) and
0.02-scale projections, which still move every greedy token (checked below); with
0.2-scale projections random models are chaotic and activation quantization alone
flips most greedy tokens."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, hf_logprobs

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LOGPROB_TOL = 0.15  # nats, engine (W8A8) vs transformers (dequantized W, fp32 A)
MAX_TOKENS = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- quantizers, written independently of services/ -----------------------------------
def _quantize_block(weight: torch.Tensor):
    """Per 128 x 128 block: scale = amax / 448, fp8 = weight / scale."""
    rows, cols = weight.shape
    nb, kb = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:rows, :cols] = weight
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:rows, :cols].to(FP8)
    expand = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q, scale, q.float() * expand


def _quantize_channel(weight: torch.Tensor, scale_dtype=torch.float32):
    """llm-compressor's FP8 channel strategy: one scale per output row, stored [N, 1]."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(scale_dtype)
    q = (weight / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale.float()


def _quantize_tensor(weight: torch.Tensor):
    scale = (weight.abs().amax() / FP8_MAX).reshape(1)
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale


def _fake_quant_activations(hf, group: int | None, skip=()):
    """Forward pre-hooks on transformers' projections: x -> dequant(quant(x)) per token
    (group None) or per token and `group` columns, as W8A8 kernels see their input."""

    def hook(module, args):
        (x,) = args
        shape = x.shape
        k = shape[-1]
        g = group or k
        xf = x.reshape(-1, k).float()
        pad = -k % g
        xp = torch.nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, g)
        scale = xp.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        deq = (xp / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        return (deq.view(xf.shape[0], -1)[:, :k].view(shape).to(x.dtype),)

    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in PROJECTIONS and name not in skip:
            module.register_forward_pre_hook(hook)
    return hf


# ---- checkpoints ------------------------------------------------------------------------
def _random_llama(hidden, heads, kv_heads, head_dim, inter, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # clear margins between the top logits (see the module doc)
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 1.0)
    config.architectures = ["LlamaForCausalLM"]
    return config, model


def _write(root, config, model, tensors, dequantized, quantization_config):
    """The quantized checkpoint in root/"q" and the dequantized fp32 one in root/"ref"."""
    from safetensors.torch import save_file

    model.load_state_dict(dequantized)
    model.save_pretrained(root / "ref")
    qdir = root / "q"
    qdir.mkdir()
    config.save_pretrained(qdir)
    if quantization_config is not None:
        raw = json.loads((qdir / "config.json").read_text())
        raw["quantization_config"] = quantization_config
        (qdir / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tensors.items()}, qdir / "model.safetensors")
    return qdir, root / "ref"


def _is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory):
    # hidden 320 and o_proj / down_proj outputs of 320: partial blocks along N and K
    config, model = _random_llama(hidden=320, heads=2, kv_heads=1, head_dim=128, inter=640)
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if _is_proj(name):  # every Linear of the decoder layers
            q, scale, d = _quantize_block(value)
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
    return _write(tmp_path_factory.mktemp("block"), config, model, tensors, deq, qconf)


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
    config, model = _random_llama(hidden=272, heads=4, kv_heads=2, head_dim=48, inter=336)
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if _is_proj(name) and not name.startswith(CT_IGNORED):
            if strategy == "channel":  # bf16 scales, as checkpoints saved in bf16 have
                q, scale, d = _quantize_channel(value, torch.bfloat16)
            else:
                q, scale, d = _quantize_tensor(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            deq[name] = d
        else:
            tensors[name] = deq[name] = value
    root = tmp_path_factory.mktemp(f"ct-{strategy}")
    return strategy, *_write(root, config, model, tensors, deq, _ct_config(strategy))


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory):
    config, model = _random_llama(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=384)
    state = model.state_dict()
    deq = {n: _quantize_channel(v)[2] if _is_proj(n) else v for n, v in state.items()}
    return _write(tmp_path_factory.mktemp("online"), config, model, state, deq, None)


# ---- the comparison ----------------------------------------------------------------------
def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100, 150, 230)]


def _compare(llm, reference, group, skip=()):
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params)
    hf = hf_load(reference)
    agree, worst = 0, 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out.output.token_ids
        agree += tokens == hf_greedy(hf, prompt, MAX_TOKENS, ignore_eos=True)
        ref_lp = hf_logprobs(hf, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            worst = max(worst, abs(entry[token].logprob - ref_lp[pos, token].item()))
    assert worst <= LOGPROB_TOL, f"logprob differs by {worst:.3g} nats"
    assert agree >= 7, f"greedy tokens equal on {agree}/8 prompts only"
    # the same weights and the same activation quantization in transformers: exact
    emulated = _fake_quant_activations(hf_load(reference), group, skip)
    for prompt, out in zip(prompts, outs):
        tokens = out.output.token_ids
        assert tokens == hf_greedy(emulated, prompt, MAX_TOKENS, ignore_eos=True)
        ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            assert entry[token].logprob == pytest.approx(ref_lp[pos, token].item(), abs=1e-3)
    # the projections matter: without them (transformers, zeroed) the tokens change
    plain = hf_load(reference)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if _is_proj(name):
                p.zero_()
    moved = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out.output.token_ids
        ref_lp = hf_logprobs(plain, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            moved = max(moved, abs(entry[token].logprob - ref_lp[pos, token].item()))
    assert moved >= 3 * LOGPROB_TOL, f"the layers move logprobs by {moved:.3g} nats only"
    assert_all_blocks_free(llm)


def _fp8_layers(llm):
    from services.models.fp8_linear import Fp8Linear

    model = llm.engine.runner.model
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _assert_fp8_memory(llm, expected_layers: set[str], granularity: str):
    layers = _fp8_layers(llm)
    assert set(layers) == expected_layers
    for name, layer in layers.items():
        assert layer.weight.dtype == FP8, name
        assert layer.weight.element_size() == 1
        assert layer.fp8_format.granularity in granularity.split("|"), name
    # nothing else in the decoder holds a projection-sized full-precision weight
    model = llm.engine.runner.model
    wide = [
        n
        for n, p in model.named_parameters()
        if p.dim() == 2
        and p.dtype != FP8
        and "embed" not in n
        and "lm_head" not in n
        and not n.endswith("weight_scale")
    ]
    return wide


def _all_layers(num_layers=2, skip=()):
    names = {
        f"model.layers.{i}.{m}"
        for i in range(num_layers)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    return names - set(skip)


def test_block_fp8_checkpoint_stays_fp8_and_tracks_transformers(block_fp8):
    qdir, reference = block_fp8
    llm = LLM(str(qdir), max_num_batched_tokens=128)
    wide = _assert_fp8_memory(llm, _all_layers(), "block")
    assert wide == []
    qkv = _fp8_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    assert tuple(qkv.weight_scale.shape) == (4, 3)  # 512 rows, 320 columns in 128-blocks
    _compare(llm, reference, group=BLOCK)


def test_compressed_tensors_fp8_dynamic_stays_fp8_and_tracks_transformers(compressed_tensors):
    strategy, qdir, reference = compressed_tensors
    llm = LLM(str(qdir), max_num_batched_tokens=128)
    # fused layers keep a per-tensor checkpoint's shard scales per row (exact)
    wide = _assert_fp8_memory(
        llm,
        _all_layers(skip=[CT_IGNORED]),
        "channel" if strategy == "channel" else "channel|tensor",
    )
    assert wide == [f"{CT_IGNORED}.weight"]  # honoured `ignore`: kept in full precision
    if strategy == "tensor":
        assert (
            _fp8_layers(llm)["model.layers.0.self_attn.o_proj"].fp8_format.granularity == "tensor"
        )
    _compare(llm, reference, group=None, skip=[CT_IGNORED])


def test_online_fp8_quantization_of_an_unquantized_checkpoint(unquantized):
    qdir, reference = unquantized
    llm = LLM(str(qdir), quantization="fp8", max_num_batched_tokens=128)
    assert _assert_fp8_memory(llm, _all_layers(), "channel") == []
    _compare(llm, reference, group=None)


def test_dummy_weights_with_an_fp8_config_are_fp8(block_fp8):
    qdir, _ = block_fp8
    llm = LLM(str(qdir), load_format="dummy", num_kv_blocks=16)
    layers = _fp8_layers(llm)
    assert set(layers) == _all_layers()
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


def _with_quant(src, dst, **edits):
    path = shutil.copytree(src, dst)
    raw = json.loads((path / "config.json").read_text())
    for dotted, value in edits.items():
        node = raw["quantization_config"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


_DELETE = object()


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
        LLM(_with_quant(ct_config_only, tmp_path / "c", **edits), num_kv_blocks=8)


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
    other = _with_quant(qdir, tmp_path / "per-tensor", weight_block_size=_DELETE)
    with pytest.raises(
        ValueError, match="'fp8' without weight_block_size.*supported: unquantized.*compressed"
    ):
        LLM(other, num_kv_blocks=8)


def test_fp8_moe_checkpoint_dense_layers_fp8_experts_dequantized(tmp_path, caplog):
    """A compressed-tensors FP8 Qwen3-MoE (experts stored per expert in FP8 with their
    scales, the router ignored as published configs do): attention and the dense MLP
    stay FP8, the experts are dequantized into the stacked w13 / w2 (logged), and the
    model computes what transformers computes on those weights with the same
    activation quantization."""
    from safetensors.torch import load_file, save_file

    from tests.engine.helpers import save_random_moe_model

    src = save_random_moe_model(tmp_path / "moe", "qwen3_moe")
    tensors, deq = {}, {}
    for name, value in load_file(src / "model.safetensors").items():
        if _is_proj(name):  # attention, the dense layer's MLP and every expert
            q, scale, d = _quantize_channel(value)
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

    with caplog.at_level("WARNING"):
        llm = LLM(str(qdir), max_num_batched_tokens=64)
    assert "expert weights dequantized at load" in caplog.text
    layers = _fp8_layers(llm)
    assert "model.layers.1.mlp.gate_up_proj" in layers  # layer 1 is dense (mlp_only_layers)
    assert "model.layers.0.self_attn.qkv_proj" in layers
    model = llm.engine.runner.model
    moe = model.model.layers[0].mlp
    assert type(moe.gate).__name__ == "Linear" and moe.gate.weight.dtype == torch.float32
    expert3_up = deq["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(moe.w13[3, moe.intermediate_size :], expert3_up)
    assert torch.equal(moe.w2[5], deq["model.layers.0.mlp.experts.5.down_proj.weight"])
    emulated = _fake_quant_activations(hf_load(ref), None)
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        tokens = out.output.token_ids
        assert tokens == hf_greedy(emulated, prompt, 4, ignore_eos=True)
        ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            assert entry[token].logprob == pytest.approx(ref_lp[pos, token].item(), abs=1e-3)
    assert_all_blocks_free(llm)
