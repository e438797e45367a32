"""FP8 KV-cache scales in checkpoints: each attention layer's k_scale / v_scale, under
the names vLLM reads them (its weight_utils.maybe_remap_kv_scale_name and
compressed-tensors' get_cache_scale):

- `<layer>.self_attn.k_scale` / `.v_scale`: AutoFP8, llm-compressor, vLLM's fp8
- `<layer>.self_attn.k_proj.k_scale` / `.v_proj.v_scale`: NVIDIA ModelOpt
- `<layer>.self_attn.k_proj.output_scale` / `.v_proj.output_scale`: compressed-tensors
  (llm-compressor's kv_cache_scheme)
- `<layer>.self_attn.kv_scale`: the deprecated single scale, used for K and V

One scalar per layer and cache (stored = value / scale). Per-head scales and query /
probability scales (`q_scale`, `prob_scale`: FP8 attention math) are not supported and
stay "unexpected weight"s. The runner uses the scales only with kv_cache_dtype fp8."""

from __future__ import annotations

import math
import re

import torch

_NAME = re.compile(
    r"(?P<attn>.+\.self_attn)\."
    r"(?:(?P<which>k|v|kv)_scale|(?P<proj>k|v)_proj\.(?:(?P=proj)_scale|output_scale))"
)


def kv_scale_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(attention module path, ("k_scale",) / ("v_scale",) / both) for a KV-cache scale
    tensor's name, else None."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    which = m.group("which") or m.group("proj")
    return m.group("attn"), ("k_scale", "v_scale") if which == "kv" else (f"{which}_scale",)


def load_kv_scale(model, name: str, tensor: torch.Tensor) -> None:
    """Set the attention layer's k_scale / v_scale (a host float) from the checkpoint
    tensor `name`; raises ValueError for an unknown layer or a scale that is not one
    positive finite number."""
    path, attrs = kv_scale_name(name)
    try:
        attn = model.get_submodule(path)
    except AttributeError:
        attn = None
    if attn is None or not all(hasattr(attn, a) for a in attrs):
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    if tensor.numel() != 1:
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)}; one KV-cache scale per layer is "
            "supported (not per head)"
        )
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: a KV-cache scale must be positive and finite, got {value}")
    for attr in attrs:
        old = getattr(attn, attr)
        if old is not None and old != value:
            raise ValueError(f"{name}: {path}.{attr} given twice ({old} and {value})")
        setattr(attn, attr, value)
