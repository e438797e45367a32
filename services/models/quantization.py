"""Quantized checkpoints: which formats load, from which config keys and tensor names,
and which layers they make FP8.

Supported, all kept in FP8 in memory (Fp8Linear, fp8_linear.py) with activations
quantized dynamically at every matmul (services/kernels/fp8.py):

- block-wise FP8 as Qwen3-*-FP8 and DeepSeek-V3 ship it: config.json
  `quantization_config: {quant_method: "fp8", weight_block_size: [128, 128],
  activation_scheme: "dynamic"}`; each quantized Linear stores `<name>.weight`
  (float8_e4m3fn) and `<name>.weight_scale_inv` (one float32 scale per block;
  dequantized = fp8 * scale). `modules_to_not_convert` / `ignored_layers` stay
  unquantized.
- compressed-tensors float-quantized FP8 as llm-compressor's FP8_DYNAMIC writes it:
  `quantization_config: {quant_method: "compressed-tensors", format: "float-quantized",
  config_groups: {<one group>: {weights: {num_bits: 8, type: "float", strategy:
  "channel" | "tensor", symmetric: true, dynamic: false}, input_activations: {num_bits:
  8, type: "float", strategy: "token", dynamic: true}, targets: ["Linear"]}}, ignore:
  [...]}`; tensors `<name>.weight` (float8_e4m3fn) and `<name>.weight_scale` ([N, 1]
  per channel, [1] or a scalar per tensor). Anything else in that config is refused
  at start, naming the key.
- compressed-tensors block FP8 as llm-compressor's FP8_BLOCK writes it: the same
  config with `weights: {strategy: "block", block_structure: [128, 128], ...}` and
  `input_activations: {strategy: "group", group_size: 128, dynamic: true, ...}`;
  `<name>.weight_scale` holds one scale per block ([ceil(N/128), ceil(K/128)], in the
  model's dtype, bf16 for a bf16 model). The same math as `weight_scale_inv`, so the
  same block-scaled layers, kernels and tensor-parallel splits. Partial edge blocks
  are stored truncated (current compressed-tensors) or, from the releases that padded
  them, padded to whole blocks with `<name>.weight_shape_original` (the loader trims
  them). The activation groups must be the weight's K blocks (vLLM's kernels assume
  so too); static activation scales are refused.
- online quantization of an unquantized checkpoint (`quantization="fp8"`,
  `--quantization fp8`): per-output-channel scales computed at load.

Which layers: every Linear of the decoder layers (attention and dense MLP
projections) that the config targets and does not ignore. The embedding, the LM head
and MoE routers always stay in the engine's dtype. MoE experts (the stacked w13 / w2
of FusedMoE) are dequantized to the engine's dtype at load (logged once): there is no
FP8 fused-MoE kernel yet. Any other `quantization_config` is refused at start, naming
the method and listing the supported ones."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from services.kernels.fp8 import FP8_DTYPE, Fp8Format, dequantize_weight, is_pow2

log = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)  # engine argument `quantization` (vLLM's spelling)
SUPPORTED = (
    "unquantized bfloat16 / float16 / float32 checkpoints (optionally quantized at load "
    "with --quantization fp8), fp8 with weight_block_size (block-wise, as Qwen3-*-FP8 / "
    "DeepSeek-V3 ship), and compressed-tensors float-quantized FP8 with channel or "
    "tensor weight scales and dynamic per-token activations (llm-compressor FP8_DYNAMIC) "
    "or block weight scales and dynamic per-group activations (llm-compressor FP8_BLOCK)"
)


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's (or the online) FP8 quantization, as the loader applies it."""

    method: str  # "fp8" (block-wise), "compressed-tensors", "fp8-online"
    granularity: str  # how the checkpoint stores scales: block / channel / tensor
    block_n: int = 0
    block_k: int = 0
    scale_suffix: str = ""  # checkpoint tensor "<layer><suffix>"; "" when online
    ignore: tuple[str, ...] = ()  # module names / "re:" patterns left unquantized
    targets: tuple[str, ...] = ("Linear",)  # "Linear" (every one) or names / "re:"
    # the config key that sets block_n x block_k (refusals name it)
    block_key: str = "weight_block_size"

    @property
    def online(self) -> bool:
        return self.method == "fp8-online"

    def layer_format(self, fused: bool) -> Fp8Format:
        if self.granularity == "block":
            return Fp8Format("block", self.block_n, self.block_k)
        # a fused layer (qkv, gate_up) from a per-tensor checkpoint has one scale per
        # shard: it keeps them per row, which is exact (vLLM requantizes to the max)
        if self.granularity == "tensor" and not fused:
            return Fp8Format("tensor")
        return Fp8Format("channel")

    def quantizes(self, checkpoint_names: list[str], ours: str) -> bool:
        """Whether the layer `ours`, which the checkpoint stores as `checkpoint_names`
        (several for a fused layer), is FP8. A fused layer must be all or nothing."""
        chosen = [self._matches(self.targets, n) and not self._ignored(n) for n in checkpoint_names]
        if any(chosen) and not all(chosen):
            key = "ignore" if self.method == "compressed-tensors" else "modules_to_not_convert"
            raise ValueError(
                f"quantization_config.{key} leaves only some of {checkpoint_names} "
                f"unquantized; they are fused into one layer here ({ours})"
            )
        return all(chosen)

    def _ignored(self, name: str) -> bool:
        if self.method == "compressed-tensors":
            return any(_ct_match(p, name) for p in self.ignore)
        # fp8: transformers' modules_to_not_convert / vLLM's ignored_layers name modules,
        # whole names or their last components ("lm_head", "mlp.gate")
        return any(_ct_match(p, name) or name.endswith("." + p) or name == p for p in self.ignore)

    @staticmethod
    def _matches(targets, name: str) -> bool:
        return any(t == "Linear" or _ct_match(t, name) for t in targets)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
        """fp32 weight from a checkpoint's FP8 tensor and its scale (MoE experts)."""
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: expected float8_e4m3fn, the checkpoint has {weight.dtype}")
        rows, cols = weight.shape
        if self.granularity == "block":
            fmt = Fp8Format("block", self.block_n, self.block_k)
        elif self.granularity == "tensor":
            fmt = Fp8Format("tensor")
        else:
            fmt = Fp8Format("channel")
        want = fmt.scale_shape(rows, cols)
        if self.granularity == "block":
            ok = tuple(scale.shape) == want
        elif self.granularity == "tensor":
            ok = scale.numel() == 1
        else:
            ok = scale.numel() == rows and scale.shape[0] == rows
        if not ok:
            raise ValueError(
                f"{name}{self.scale_suffix}: shape {tuple(scale.shape)}, expected {want} for "
                f"a {rows} x {cols} weight ({self.granularity} scales)"
            )
        shaped = scale.reshape(want) if self.granularity != "block" else scale
        return dequantize_weight(weight, shaped, fmt)


def _ct_match(pattern: str, name: str) -> bool:
    """compressed-tensors' matching: the exact module name, or "re:<regex>" (re.match)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def quantization_of(hf_config, quantization: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (or the online one asked for), None for neither.
    Raises ValueError naming the config key for anything not supported."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}"
        )
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        if quantization == "fp8":
            return QuantConfig(method="fp8-online", granularity="channel")
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if method == "fp8" and quant.get("weight_block_size"):
        # an FP8 checkpoint with --quantization fp8 is that same FP8 (as in vLLM)
        return _block_fp8(quant)
    if method == "compressed-tensors":
        if quantization is not None:
            raise ValueError(
                f"--quantization {quantization} asks to quantize at load, but the checkpoint "
                "is already quantized (quantization_config.quant_method 'compressed-tensors'): "
                "drop --quantization"
            )
        return _compressed_tensors(quant)
    what = f"quant_method {method!r}" + (" without weight_block_size" if method == "fp8" else "")
    raise ValueError(
        f"quantization_config with {what} (config.json) is not supported; supported: {SUPPORTED}"
    )


def _check_blocks(path: str, block) -> tuple[int, int]:
    """[block_n, block_k] as the FP8 GEMMs take them: positive, block_k a power of two
    of at least 16 (the GEMMs step through K in tiles inside one scale block)."""
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise ValueError(f"quantization_config.{path} {block!r} (config.json) is not [n, k]")
    if block[1] < 16 or not is_pow2(block[1]):
        raise ValueError(
            f"quantization_config.{path} {list(block)!r} (config.json) is not supported: "
            "the FP8 GEMMs need a block k (its second entry) that is a power of two >= 16"
        )
    return int(block[0]), int(block[1])


def _block_fp8(quant: dict) -> QuantConfig:
    block_n, block_k = _check_blocks("weight_block_size", quant["weight_block_size"])
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {quant['activation_scheme']!r} is "
            "not supported (dynamic only)"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {quant['fmt']!r} is not supported (e4m3 only)")
    ignore = tuple(quant.get("modules_to_not_convert") or ()) + tuple(
        quant.get("ignored_layers") or ()
    )
    return QuantConfig(
        method="fp8",
        granularity="block",
        block_n=block_n,
        block_k=block_k,
        scale_suffix=".weight_scale_inv",
        ignore=ignore,
    )


def _compressed_tensors(quant: dict) -> QuantConfig:
    key = "quantization_config"

    def refuse(path: str, value, supported: str):
        raise ValueError(
            f"{key}.{path} = {value!r} (config.json) is not supported; supported: {supported}"
        )

    fmt = quant.get("format")
    if fmt != "float-quantized":
        refuse("format", fmt, "'float-quantized' (FP8)")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        refuse("quantization_status", status, "'compressed'")
    if quant.get("sparsity_config"):
        refuse("sparsity_config", quant["sparsity_config"], "none")
    kv = quant.get("kv_cache_scheme")
    if kv:
        # per-layer static K / V scales: the loader reads them (kv_scales.py) and the
        # engine uses them with kv_cache_dtype fp8; nothing finer is supported
        _expect(kv, "kv_cache_scheme", num_bits=8, type="float", strategy="tensor", dynamic=False)
    unknown = sorted(k for k, v in quant.items() if v and k not in _CT_KEYS)
    if unknown:
        refuse(unknown[0], quant[unknown[0]], "absent")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        refuse("config_groups", sorted(groups), "exactly one group (one scheme for every target)")
    ((name, group),) = groups.items()
    path = f"config_groups.{name}"
    extra = sorted(k for k, v in group.items() if v is not None and k not in _CT_GROUP_KEYS)
    if extra:
        refuse(f"{path}.{extra[0]}", group[extra[0]], "absent")
    if group.get("format") not in (None, "float-quantized"):
        refuse(f"{path}.format", group["format"], "'float-quantized'")
    targets = group.get("targets") or []
    if not targets:
        refuse(f"{path}.targets", targets, "['Linear'] or module names / 're:' patterns")
    weights = group.get("weights") or {}
    _check_args(weights, f"{path}.weights", dynamic=False)
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        refuse(f"{path}.weights.strategy", strategy, "'channel', 'tensor', 'block'")
    nulls = ("group_size", "actorder") + (() if strategy == "block" else ("block_structure",))
    for key in nulls:
        if weights.get(key) is not None:
            refuse(f"{path}.weights.{key}", weights[key], "null")
    acts = group.get("input_activations")
    if acts is None:
        refuse(
            f"{path}.input_activations",
            None,
            "dynamic per-token (FP8_DYNAMIC) or per-group (FP8_BLOCK) FP8 activations",
        )
    acts_path = f"{path}.input_activations"
    _check_args(acts, acts_path, dynamic=True)
    for key in ("block_structure", "actorder"):
        if acts.get(key) is not None:
            refuse(f"{acts_path}.{key}", acts[key], "null")
    if group.get("output_activations") is not None:
        refuse(f"{path}.output_activations", group["output_activations"], "null")
    common = dict(
        method="compressed-tensors",
        scale_suffix=".weight_scale",
        ignore=tuple(quant.get("ignore") or ()),
        targets=tuple(targets),
    )
    if strategy != "block":
        if acts.get("strategy") != "token":
            refuse(f"{acts_path}.strategy", acts.get("strategy"), "'token'")
        if acts.get("group_size") is not None:
            refuse(f"{acts_path}.group_size", acts["group_size"], "null")
        return QuantConfig(granularity=strategy, **common)
    # block weights: the activations' groups must be the blocks along K, as the kernels
    # quantize them (per token and block_k columns)
    block_key = f"{path}.weights.block_structure"
    block = weights.get("block_structure")
    if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):  # older "128x128"
        block = [int(b) for b in block.split("x")]
    block_n, block_k = _check_blocks(block_key, block)
    if acts.get("strategy") != "group":
        refuse(f"{acts_path}.strategy", acts.get("strategy"), "'group' with block weights")
    if acts.get("group_size") != block_k:
        refuse(
            f"{acts_path}.group_size",
            acts.get("group_size"),
            f"{block_k} (the weights' block_structure along K)",
        )
    return QuantConfig(
        granularity="block", block_n=block_n, block_k=block_k, block_key=block_key, **common
    )


# compressed-tensors config keys understood above, or that change nothing computed
_CT_KEYS = {
    "quant_method",
    "format",
    "quantization_status",
    "sparsity_config",
    "kv_cache_scheme",
    "config_groups",
    "ignore",
    "global_compression_ratio",
    "version",
    "provider",
}


# a config_groups entry (compressed-tensors' QuantizationScheme)
_CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
# compressed-tensors' QuantizationArgs fields, with the defaults of those a saved config
# may leave out. scale_dtype / zp_dtype describe tensors read as they are (zero points
# exist only for asymmetric schemes, refused); observers only matter when calibrating.
_CT_ARGS_DEFAULTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
_CT_ARGS_KEYS = {
    *_CT_ARGS_DEFAULTS,
    "strategy",
    "group_size",
    "block_structure",
    "actorder",
    "scale_dtype",
    "zp_dtype",
    "observer",
    "observer_kwargs",
}


def _check_args(section: dict, path: str, dynamic: bool) -> None:
    """A QuantizationArgs section: 8-bit symmetric floats, static or dynamic as asked,
    and no field this loader does not know."""
    unknown = sorted(k for k, v in section.items() if v is not None and k not in _CT_ARGS_KEYS)
    if unknown:
        raise ValueError(
            f"quantization_config.{path}.{unknown[0]} = {section[unknown[0]]!r} (config.json) "
            "is not supported; supported: absent"
        )
    filled = {**_CT_ARGS_DEFAULTS, **{k: v for k, v in section.items() if v is not None}}
    _expect(filled, path, num_bits=8, type="float", symmetric=True, dynamic=dynamic)


def _expect(section: dict, path: str, **want) -> None:
    for k, v in want.items():
        if section.get(k) != v:
            raise ValueError(
                f"quantization_config.{path}.{k} = {section.get(k)!r} (config.json) is not "
                f"supported; supported: {v!r}"
            )
