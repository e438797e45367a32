"""What the FP8 checkpoint tests share: quantizers written independently of services/,
small random Llama checkpoints written in a format's exact on-disk form beside their
dequantized fp32 twin, and the comparison of the engine with transformers on the
twin.

The acceptance (`compare`): the engine also quantizes activations (dynamically, per
token / per 128-group), so against transformers on the dequantized weights it holds
within a tolerance: every generated token's logprob within LOGPROB_TOL nats of
transformers' on the same tokens, and the 8 greedy tokens equal on at least 7 of 8
prompts. Against transformers with the same activation quantization applied to its
Linear inputs (forward pre-hooks, `fake_quant_activations`) the engine is exact up to
fp32 summation order: tokens equal and logprobs within 1e-3.

The random models have unit-scale embeddings and LM head (clear logit margins) and
0.02-scale projections, which still move every greedy token (checked in `compare`);
with 0.2-scale projections random models are chaotic and activation quantization
alone flips most greedy tokens."""

from __future__ import annotations

import json
import random
import shutil

import torch

from services.engine import SamplingParams
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, hf_logprobs

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LOGPROB_TOL = 0.15  # nats, engine (W8A8) vs transformers (dequantized W, fp32 A)
MAX_TOKENS = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- quantizers, written independently of services/ -----------------------------------
def quantize_block(weight: torch.Tensor, scale_dtype=torch.float32):
    """Per 128 x 128 block: scale = amax / 448 (stored in scale_dtype; the weight is
    divided by the stored scale, as compressed-tensors does), fp8 = weight / scale."""
    rows, cols = weight.shape
    nb, kb = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:rows, :cols] = weight
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    s = scale.float()[:, None, :, None]
    q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).view(nb * BLOCK, kb * BLOCK)[:rows, :cols].to(FP8)
    expand = scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)
    return q, scale, q.float() * expand[:, :cols]


def quantize_channel(weight: torch.Tensor, scale_dtype=torch.float32):
    """llm-compressor's FP8 channel strategy: one scale per output row, stored [N, 1]."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(scale_dtype)
    q = (weight / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale.float()


def quantize_tensor(weight: torch.Tensor):
    scale = (weight.abs().amax() / FP8_MAX).reshape(1)
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale


def fake_quant(x: torch.Tensor, group: int | None, dtype=FP8) -> torch.Tensor:
    """x -> dequant(quant(x)) per token (group None) or per token and `group` columns,
    as W8A8 kernels see their input, in FP8 `dtype` (e4m3fn: max 448; e4m3fnuz: 240)."""
    top = torch.finfo(dtype).max
    shape = x.shape
    k = shape[-1]
    g = group or k
    xf = x.reshape(-1, k).float()
    pad = -k % g
    xp = torch.nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, g)
    # divided by a tensor: on CUDA torch divides by a Python number through its
    # reciprocal, one ulp off the correctly rounded scale the kernels use
    scale = xp.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.tensor(top, device=x.device)
    deq = (xp / scale).clamp(-top, top).to(dtype).float() * scale
    return deq.view(xf.shape[0], -1)[:, :k].view(shape).to(x.dtype)


def fake_quant_activations(hf, group: int | None, skip=(), dtype=FP8):
    """Forward pre-hooks on transformers' projections: their inputs through fake_quant."""

    def hook(module, args):
        (x,) = args
        return (fake_quant(x, group, dtype),)

    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in PROJECTIONS and name not in skip:
            module.register_forward_pre_hook(hook)
    return hf


def fake_quant_experts(hf, group: int | None = BLOCK) -> None:
    """transformers' stacked experts with their inputs quantized per token and `group`
    columns (None: the whole row), as the fused MoE's W8A8 GEMMs see them (the loop of
    Qwen3MoeExperts)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, pos = torch.where(top_k_index == e)
            x = fake_quant(hidden_states[token], group)
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = fake_quant(self.act_fn(gate) * up, group)
            h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token, pos, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    for module in hf.modules():
        if isinstance(module, Qwen3MoeExperts):
            module.forward = forward.__get__(module)


# ---- checkpoints ------------------------------------------------------------------------
def random_llama(hidden, heads, kv_heads, head_dim, inter, seed=0):
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


def write_checkpoints(root, config, model, tensors, dequantized, quantization_config):
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


def is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def with_quant(src, dst, **edits):
    """A copy of checkpoint folder src at dst with quantization_config edited: keys are
    paths joined by "__", values the new values (DELETE removes the key)."""
    path = shutil.copytree(src, dst)
    raw = json.loads((path / "config.json").read_text())
    for dotted, value in edits.items():
        node = raw["quantization_config"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


DELETE = object()


# ---- the comparison ----------------------------------------------------------------------
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 100, 150, 230)]


def compare(
    llm, reference, group, skip=(), device="cpu", emulate=None, emulation_tol=1e-3, exact=True
):
    """The acceptance of the module doc, for an engine on a quantized checkpoint and
    transformers on its dequantized twin `reference`; `group`: the activation groups
    (None: per token), `skip`: transformers modules the checkpoint leaves unquantized,
    `device`: where transformers runs (the engine's, so the fp32 activations that FP8
    rounds come from the same kind of arithmetic); `emulate`: a further change to the
    emulating model (MoE experts, which are no Linear modules there); `emulation_tol`:
    nats between the engine and that emulation (fp32 summation order only, unless the
    engine's kernels accumulate less precisely: test_gpu_fp8.py). On a CPU the exact
    emulation needs the reference kernels (kernel_backend="torch"): an activation that
    FP8 rounds comes out of RMSNorm, attention or SiLU, and a kernel that sums in another
    order can move it across a rounding boundary (the C kernels of cpu_native, which
    test_cpu_native.py holds to the reference). exact=False checks the tracking alone."""
    if exact and device == "cpu":
        assert llm.engine.runner.ops.name == "torch", "the exact emulation needs torch kernels"
    prompt_ids = prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompt_ids, params)

    def load():
        return hf_load(reference).to(device)

    hf = load()
    agree, worst = 0, 0.0
    for prompt, out in zip(prompt_ids, outs):
        tokens = out.output.token_ids
        agree += tokens == hf_greedy(hf, prompt, MAX_TOKENS, ignore_eos=True)
        ref_lp = hf_logprobs(hf, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            worst = max(worst, abs(entry[token].logprob - ref_lp[pos, token].item()))
    assert worst <= LOGPROB_TOL, f"logprob differs by {worst:.3g} nats"
    assert agree >= 7, f"greedy tokens equal on {agree}/8 prompts only"
    if not exact:
        return
    # the same weights and the same activation quantization in transformers: exact
    emulated = fake_quant_activations(load(), group, skip)
    if emulate is not None:
        emulate(emulated)
    for prompt, out in zip(prompt_ids, outs):
        tokens = out.output.token_ids
        assert tokens == hf_greedy(emulated, prompt, MAX_TOKENS, ignore_eos=True)
        ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            ref = ref_lp[pos, token].item()
            assert abs(entry[token].logprob - ref) <= emulation_tol, (prompt, pos, ref)
    # the projections matter: without them (transformers, zeroed) the tokens change
    plain = load()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if is_proj(name):
                p.zero_()
    moved = 0.0
    for prompt, out in zip(prompt_ids, outs):
        tokens = out.output.token_ids
        ref_lp = hf_logprobs(plain, prompt + tokens[:-1])[len(prompt) - 1 :]
        for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
            moved = max(moved, abs(entry[token].logprob - ref_lp[pos, token].item()))
    assert moved >= 3 * LOGPROB_TOL, f"the layers move logprobs by {moved:.3g} nats only"
    assert_all_blocks_free(llm)


def fp8_layers(llm_or_model):
    from services.models.fp8_linear import Fp8Linear

    model = getattr(llm_or_model, "engine", None)
    model = model.runner.model if model is not None else llm_or_model
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def assert_fp8_memory(llm, expected_layers: set[str], granularity: str):
    """Every expected layer (and no other) is FP8 with one of the `granularity`
    ("a|b") formats; returns the decoder's other 2-D full-precision weights."""
    layers = fp8_layers(llm)
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


def all_layers(num_layers=2, skip=()):
    names = {
        f"model.layers.{i}.{m}"
        for i in range(num_layers)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    return names - set(skip)
