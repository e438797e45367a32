"""Find a model's folder and load its weights into our model classes.

A model is (a) a Hugging Face folder with config.json + *.safetensors + tokenizer
files, (b) a short alias for the bundled default model, or (c) any folder with a
config.json loaded with load_format="dummy" (random weights, for benchmarks)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch
from safetensors import safe_open

from services.kernels import KernelBackend
from services.models import default_model
from services.models.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_model_path(model: str) -> Path:
    if default_model.is_alias(model):
        return default_model.default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    raise ValueError(
        f"unknown model {model!r}: not a folder and not an alias "
        f"(aliases: {', '.join(default_model.known_aliases())})"
    )


def load_hf_config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def load_model(
    hf_config,
    model_path: Path,
    ops: KernelBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    load_format: str = "auto",
    seed: int = 0,
):
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cls = model_class(hf_config)
    # Build on the meta device: skips the random init of every Linear (seconds on CPU).
    with torch.device("meta"):
        model = cls(hf_config, ops)
    model.to(dtype)  # free on meta; allocating in the final dtype halves peak memory
    model.to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, model_path)
    # RoPE tables stay fp32: bf16 angles lose the position precision long contexts need.
    model.init_rope_cache(max_position, device)
    return model.eval()


def _init_dummy(model, seed: int) -> None:
    # Drawn on the model's device in its dtype: an 8B model must not pass through the CPU.
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.05, 0.05, generator=gen)


def _load_safetensors(model, model_path: Path) -> None:
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)  # checkpoints may omit unit norms; never leave garbage
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _load_tensor(model, params, name, f.get_tensor(name))
                if target:
                    loaded.add(target)
    missing = [n for n in params if n not in loaded]
    if model.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights for {missing[:5]}")


def _load_tensor(model, params, name: str, tensor: torch.Tensor) -> str | None:
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return None
    for ckpt_name, (fused, shard) in model.packed_modules.items():
        if f".{ckpt_name}." in name:
            target = name.replace(ckpt_name, fused)
            start, size = model.shard_slice(fused, shard)
            params[target].data[start : start + size].copy_(tensor)
            return target
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    params[name].data.copy_(tensor)
    return name
