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
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position: [len, vocab]."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def save_random_model(path: Path, kind: str, seed: int = 0) -> Path:
    """A small random-weight Llama (llama3 rope scaling, untied head) or Qwen3."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
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
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def assert_all_blocks_free(llm_or_engine):
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, (
        f"KV blocks leaked: {bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} still held"
    )
    assert not engine.requests, f"requests left behind: {list(engine.requests)}"
