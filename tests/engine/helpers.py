"""Reference generation with transformers and small random checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_load(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False):
    """transformers' own greedy generate(), one prompt at a time (no padding)."""
    inputs = torch.tensor([prompt_ids], device=model.device)
    kwargs = dict(
        do_sample=False, max_new_tokens=max_new_tokens, top_k=None, top_p=None, temperature=None
    )
    if ignore_eos:  # vLLM's meaning: EOS may be generated, it just does not stop (no
        # token id is -1; min_new_tokens would suppress EOS instead)
        kwargs["eos_token_id"] = -1
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position: [len, vocab]."""
    logits = model(torch.tensor([token_ids], device=model.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


# what every small random test model shares
_SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def _random_biases(model, std: float) -> None:
    """transformers initializes biases to zero; a checkpoint's are not, and a test must
    see whether they are loaded and added."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)


def save_random_model(path: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """A small random-weight Llama (llama3 rope scaling, untied head), Qwen3, Qwen2
    (q/k/v biases, tied embeddings), Phi-3 (fused q/k/v and gate/up tensors) or Mistral
    (sliding_window null unless overridden). overrides: config fields, given to the
    config's constructor (Qwen's layer_types derive from use_sliding_window there)."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(_SMALL, intermediate_size=256, initializer_range=0.5, **overrides)
    if kind == "llama":
        config = LlamaConfig(
            **common,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif kind == "qwen3":
        config = Qwen3Config(
            **common,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    elif kind == "phi3":  # q/k/v and gate/up stored fused, as Phi-3 / Phi-4 ship
        config = Phi3Config(
            **common,
            tie_word_embeddings=False,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif kind == "qwen2":
        config = Qwen2Config(
            **common,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    elif kind == "mistral":  # MistralForCausalLM, served by our Llama class
        config = MistralConfig(
            **{"sliding_window": None, **common},
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _random_biases(model, config.initializer_range)
    model.save_pretrained(path)
    return path


def save_random_moe_model(path: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """A small random-weight Qwen3-MoE (8 experts, top-2, renormalized, layer 1 dense
    through mlp_only_layers), Qwen2-MoE (the same, not renormalized, with a shared expert
    and q/k/v biases) or Mixtral (8 experts, top-2), written as the published
    checkpoints are: one tensor per expert and projection (Qwen3-MoE, Qwen2-MoE:
    mlp.experts.E.{gate,up,down}_proj.weight; Mixtral: block_sparse_moe.experts.E.w1 /
    w3 / w2 and block_sparse_moe.gate), not transformers 5's stacked in-memory layout.
    overrides: config fields to change (e.g. moe_intermediate_size)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        _SMALL,
        initializer_range=0.2,  # logits of a few units: fp32 sums agree to ~1e-5
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            head_dim=32,
            intermediate_size=256,  # the dense layer's
            moe_intermediate_size=64,
            num_experts=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        block, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    elif kind == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            intermediate_size=256,  # the dense layer's
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=8,
            norm_topk_prob=False,  # as Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B ship
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        block, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    elif kind == "mixtral":
        config = MixtralConfig(
            **common,
            intermediate_size=64,
            num_local_experts=8,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        block, names = "block_sparse_moe", ("w1", "w3", "w2")
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _random_biases(model, config.initializer_range)
    tensors = {}
    for name, value in model.state_dict().items():
        layer, _, rest = name.partition(".mlp.")
        if rest == "experts.gate_up_proj":
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{layer}.{block}.experts.{e}.{names[0]}.weight"] = value[e, :inter]
                tensors[f"{layer}.{block}.experts.{e}.{names[1]}.weight"] = value[e, inter:]
        elif rest == "experts.down_proj":
            for e in range(value.shape[0]):
                tensors[f"{layer}.{block}.experts.{e}.{names[2]}.weight"] = value[e]
        elif rest == "gate.weight":
            tensors[f"{layer}.{block}.gate.weight"] = value
        else:
            tensors[name] = value
    path.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    # the reference must really hold these weights (transformers converts the per-expert
    # names on load; anything it failed to map would be left random)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), f"transformers lost {name}"
    return path


def assert_all_blocks_free(llm_or_engine):
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, (
        f"KV blocks leaked: {bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} still held"
    )
    assert not engine.requests, f"requests left behind: {list(engine.requests)}"
