"""Which decoder layers attend through a sliding window, and how wide, as transformers'
own model of each family decides it (transformers 5: masking_utils'
sliding_window_overlay, a query at position q sees keys q - window < k <= q).

- Mistral, Mixtral, Phi-3, Qwen3-MoE: `sliding_window` on every layer when set (Qwen3-MoE
  only with `use_sliding_window`; transformers nulls it otherwise).
- Qwen2, Qwen2-MoE, Qwen3: per layer from `layer_types` ("sliding_attention" takes
  `sliding_window`, "full_attention" none), which transformers' config derives when the
  checkpoint has none: Qwen2 / Qwen3 slide on layers i >= `max_window_layers`, Qwen2-MoE
  on even layers i < `max_window_layers`; all only with `use_sliding_window`.
- Any other family (Llama): transformers' model ignores `sliding_window`, so full
  attention; check_supported refuses one that would bind (the weights may expect it).

The KV cache keeps every block of a windowed layer (no freeing behind the window)."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
BY_LAYER_TYPES = ("qwen2", "qwen2_moe", "qwen3")
WINDOWED_FAMILIES = EVERY_LAYER + BY_LAYER_TYPES


def active_sliding_window(hf_config) -> int | None:
    """The config's window when switched on: `sliding_window` unless null (or 0, Qwen2-MoE's
    "off") or turned off by Qwen's `use_sliding_window`. ValueError for a window that is
    not a positive int."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} (config.json) must be a positive integer")
    return window


def layer_sliding_windows(hf_config) -> list[int | None]:
    """Each decoder layer's window (None: full causal attention)."""
    num_layers = hf_config.num_hidden_layers
    window = active_sliding_window(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if window is None or model_type not in WINDOWED_FAMILIES:
        return [None] * num_layers
    if model_type in EVERY_LAYER:
        return [window] * num_layers
    layer_types = getattr(hf_config, "layer_types", None) or _derived_layer_types(hf_config)
    if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ValueError(
            f"layer_types={layer_types!r} (config.json): {num_layers} entries of "
            f"{SLIDING!r} or {FULL!r} are supported"
        )
    return [window if t == SLIDING else None for t in layer_types]


def _derived_layer_types(hf_config) -> list[str]:
    """layer_types as transformers' Qwen configs derive them when config.json has none
    (a config object that did not pass through their __post_init__)."""
    n = hf_config.num_hidden_layers
    top = getattr(hf_config, "max_window_layers", n)
    if hf_config.model_type == "qwen2_moe":
        return [SLIDING if i % 2 == 0 and i < top else FULL for i in range(n)]
    return [SLIDING if i >= top else FULL for i in range(n)]
