"""Rotary position embedding tables, including Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch


def rope_parameters(hf_config) -> dict:
    """transformers 5 stores RoPE settings in `rope_parameters`; 4.x in `rope_theta` +
    `rope_scaling`. Normalise both to one dict with at least rope_type and rope_theta."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor = float(params["factor"])
    low_freq_factor = float(params.get("low_freq_factor", 1.0))
    high_freq_factor = float(params.get("high_freq_factor", 4.0))
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(head_dim: int, max_position: int, params: dict) -> torch.Tensor:
    """[max_position, head_dim]: cos in the first half of the columns, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, params)
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
