"""Rotary position embedding tables: plain RoPE and the scalings checkpoints ship
(Llama 3.1's `llama3`, position interpolation `linear`, and `yarn`, which Qwen2.5 and
Qwen3 enable for contexts past their pretraining length)."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config) -> dict:
    """transformers 5 stores RoPE settings in `rope_parameters`; 4.x in `rope_theta` +
    `rope_scaling`. Normalise both to one dict with at least rope_type and rope_theta.
    Refuses, naming the key, what the tables here cannot express."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} (config.json rope_scaling / rope_parameters) "
            f"is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} (config.json) is not supported: RoPE here "
            "rotates the whole head"
        )
    if params["rope_type"] == "yarn":
        # as transformers: the pretraining length from the model's top-level key (Phi-3
        # style), else the scaling's own, else max_position_embeddings
        top = getattr(hf_config, "original_max_position_embeddings", None)
        if top:
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        if params.get("factor") is None:  # DeepSeek-V3 style: the ratio of the lengths
            params["factor"] = hf_config.max_position_embeddings / float(
                params["original_max_position_embeddings"]
            )
    return params


def max_positions(hf_config) -> int:
    """The context a model serves by default (max_model_len when none is given): its
    max_position_embeddings, extended by a `linear` or `yarn` scaling's factor as vLLM
    derives it (yarn: original_max_position_embeddings x factor; never less than the
    config states). llama3 configs already state the extended length."""
    length = int(getattr(hf_config, "max_position_embeddings", 2048))
    params = rope_parameters(hf_config)
    if params["rope_type"] == "linear":
        return int(length * float(params["factor"]))
    if params["rope_type"] == "yarn":
        extended = int(params["original_max_position_embeddings"]) * float(params["factor"])
        return max(length, int(extended))
    return length


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # positions divided by factor: the same as frequencies
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


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


def _yarn_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the
    pretraining length are interpolated (frequency / factor), those turning more than
    beta_fast times keep their frequency, and a linear ramp blends the band between."""
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    old_context = float(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the dimension that turns `turns` times
        return head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its frequency; 0: interpolated
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_scaling(params: dict) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, else 1."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:  # DeepSeek-V2/V3
        return float(mscale(m) / mscale(m_all))
    return mscale()


def cos_sin_cache(head_dim: int, max_position: int, params: dict) -> torch.Tensor:
    """[max_position, head_dim]: cos in the first half of the columns, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, params)
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    scale = attention_scaling(params)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1)
