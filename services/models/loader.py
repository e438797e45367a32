"""Find a model's folder and load its weights into our model classes.

A model is (a) a Hugging Face folder with config.json + *.safetensors + tokenizer
files, (b) a short alias for the bundled default model, or (c) any folder with a
config.json loaded with load_format="dummy" (random weights, for benchmarks)."""

from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from services.kernels import KernelBackend
from services.models import default_model
from services.models.quantization import SCALE_SUFFIX, quantization_of
from services.models.registry import model_class

log = logging.getLogger(__name__)

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


def check_supported(hf_config, max_model_len: int) -> None:
    """Refuse, naming the config.json key, what this engine would otherwise compute
    differently from the checkpoint's own model."""
    quantization_of(hf_config)  # raises for an unsupported method
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and max_model_len > window:
        # attention covers the whole context here, which equals windowed attention only
        # while no sequence is longer than the window
        raise ValueError(
            f"sliding_window={window} (config.json): attention here covers the whole "
            f"context, which equals the model's only up to {window} tokens; max_model_len "
            f"is {max_model_len}: pass --max-model-len {window} (or less)"
        )


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
        _load_safetensors(model, model_path, quantization_of(hf_config))
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


def _load_safetensors(model, model_path: Path, quant=None) -> None:
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path}")
    params = dict(model.named_parameters())
    expected = _expected_pieces(model, params)
    loaded: dict[str, set] = {name: set() for name in params}
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)  # checkpoints may omit unit norms; never leave garbage
    # quantized weights wait for their scales (they may sit in another file)
    fp8_weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def load(name, tensor):
        target = _load_tensor(model, params, name, tensor)
        if target:
            loaded[target[0]].add(target[1])

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if quant is not None and name.endswith(SCALE_SUFFIX):
                    scales[name.removesuffix(SCALE_SUFFIX)] = tensor
                elif quant is not None and tensor.dtype == torch.float8_e4m3fn:
                    fp8_weights[name.removesuffix(".weight")] = tensor
                else:
                    load(name, tensor)
    if quant is not None:
        if set(fp8_weights) != set(scales):
            odd = sorted(set(fp8_weights) ^ set(scales))[:5]
            raise ValueError(f"checkpoint {model_path}: FP8 weights and scales do not pair: {odd}")
        for base, weight in fp8_weights.items():
            load(f"{base}.weight", quant.dequantize(weight, scales[base], base))
        log.warning(
            "%d FP8 block-wise weights dequantized at load: no FP8 GEMM kernels yet, they take "
            "the engine dtype's memory",
            len(fp8_weights),
        )
    missing = [
        name
        for name, pieces in expected.items()
        if not pieces <= loaded[name] and not name.endswith("norm.weight")
    ]
    if model.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights for {missing[:5]}")


def _expected_pieces(model, params) -> dict[str, set]:
    """What the checkpoint must fill of each parameter: the shards of a fused one
    (q, k, v), every (expert, shard) of a stacked MoE one, else the whole (None)."""
    expected = {name: {None} for name in params}
    fused: dict[str, set] = {}
    for fused_name, shard in model.packed_modules.values():
        fused.setdefault(fused_name, set()).add(shard)
    for name in params:
        module_name = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if module_name in fused:
            expected[name] = set(fused[module_name])
    for prefix, module in model.named_modules():
        if hasattr(module, "weight_pieces"):
            for param, pieces in module.weight_pieces().items():
                expected[f"{prefix}.{param}"] = pieces
    return expected


_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(\w+)\.weight")


def _load_tensor(model, params, name: str, tensor: torch.Tensor) -> tuple[str, object] | None:
    """Copies one checkpoint tensor into its place; returns (parameter, piece)."""
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return None
    for old, new in model.checkpoint_renames.items():
        name = name.replace(old, new)
    expert = _EXPERT.fullmatch(name)
    if expert and expert.group(3) in model.expert_modules:
        prefix, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        param, shard = model.expert_modules[proj]
        module = _submodule(model, prefix)
        if module is None or not hasattr(module, "load_expert") or index >= module.num_experts:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        module.load_expert(param, index, shard, tensor)
        return f"{prefix}.{param}", (index, shard)
    for ckpt_name, (fused, shard) in model.packed_modules.items():
        if f".{ckpt_name}." in name:
            target = name.replace(ckpt_name, fused)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            start, size = model.shard_slice(fused, shard)
            _copy(params[target].data[start : start + size], tensor, name)
            return target, shard
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    _copy(params[name].data, tensor, name)
    return name, None


def _submodule(model, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    # copy_ would broadcast a wrongly shaped tensor silently
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"weight {name!r}: checkpoint shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
        )
    dst.copy_(src)
