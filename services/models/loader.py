"""Find a model's folder and load its weights into our model classes.

A model is (a) a Hugging Face folder with config.json + *.safetensors + tokenizer
files, (b) a short alias for the bundled default model, or (c) any folder with a
config.json loaded with load_format="dummy" (random weights, for benchmarks)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from services.kernels import KernelBackend
from services.kernels.fp8 import (
    FP8_DTYPE,
    FP8_DTYPES,
    fp8_format_of,
    platform_fp8_dtype,
)
from services.models import default_model, hub
from services.models.fp8_linear import Fp8Linear
from services.models.fp8_swap import use_fp8_layers
from services.models.kv_scales import kv_scale_name, load_kv_scale
from services.models.moe import FusedMoE
from services.models.quantization import QuantConfig, quantization_of
from services.models.registry import model_class
from services.models.sliding_window import (
    WINDOWED_FAMILIES,
    active_sliding_window,
    layer_sliding_windows,
)
from services.models.tensor_parallel import TPGroup, check_split

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local folder of `model`: the bundled model's alias, a folder, or a Hugging
    Face Hub id (owner/name; fetched into the Hub cache, or download_dir, first)."""
    path = Path(model).expanduser()
    alias = default_model.is_alias(model)
    if (alias or path.is_dir()) and (revision or download_dir):
        flag = "--revision" if revision else "--download-dir"
        raise ValueError(f"{flag} applies to Hugging Face Hub ids; {model!r} is local")
    if alias:
        return default_model.default_model_dir()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if hub.looks_like_repo_id(model):
        return hub.download_model(model, revision, download_dir)
    raise ValueError(
        f"unknown model {model!r}: not a folder, not a Hugging Face Hub id (owner/name) "
        f"and not an alias (aliases: {', '.join(default_model.known_aliases())})"
    )


def load_hf_config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def check_supported(
    hf_config, max_model_len: int, quantization: str | None = None, tp_size: int = 1
) -> None:
    """Refuse, naming the config.json key, what this engine would otherwise compute
    differently from the checkpoint's own model, or cannot split over tp_size ranks."""
    quantization_of(hf_config, quantization)  # raises for an unsupported method
    check_split(hf_config, tp_size)
    layer_sliding_windows(hf_config)  # raises for a window or layer_types it cannot place
    window = active_sliding_window(hf_config)
    family = getattr(hf_config, "model_type", None)
    if window and family not in WINDOWED_FAMILIES and max_model_len > window:
        # transformers' model of this family ignores the window, but the weights may
        # expect it: the two agree only while no sequence is longer than the window
        raise ValueError(
            f"sliding_window={window} (config.json) with model_type {family!r}: sliding-"
            f"window attention is applied for {', '.join(WINDOWED_FAMILIES)} only; this "
            f"model's full attention equals the window only up to {window} tokens and "
            f"max_model_len is {max_model_len}: pass --max-model-len {window} (or less)"
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
    quantization: str | None = None,
    tp: TPGroup | None = None,
    fp8_dtype: torch.dtype | None = None,
):
    """tp: this rank's tensor-parallel group; the model holds its share of the weights
    (each layer takes its slice of the checkpoint's tensors). fp8_dtype: the type FP8
    layers keep their weights in; None: the device's (fp8.platform_fp8_dtype:
    float8_e4m3fnuz on MI300, else float8_e4m3fn), given to force one (tests)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if fp8_dtype is not None and fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES} or None, got {fp8_dtype}")
    quant = quantization_of(hf_config, quantization)
    tp = tp or TPGroup()
    check_split(hf_config, tp.size)
    cls = model_class(hf_config)
    # Build on the meta device: skips the random init of every Linear (seconds on CPU).
    with torch.device("meta"):
        model = cls(hf_config, ops, tp)
    model.to(dtype)  # free on meta; allocating in the final dtype halves peak memory
    if quant is not None:  # after .to(dtype), which would cast FP8 weights and scales
        use_fp8_layers(model, quant, fp8_dtype or platform_fp8_dtype(device))
    model.to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, model_path, quant)
    # RoPE tables stay fp32: bf16 angles lose the position precision long contexts need.
    model.init_rope_cache(max_position, device)
    for attn in model.attention_layers():
        # a window no position reaches never binds: as full attention it keeps the
        # kernels' unwindowed paths (the reference's maskless decode, AITER's split-K)
        if attn.sliding_window is not None and attn.sliding_window >= max_position:
            attn.sliding_window = None
    return model.eval()


def _init_dummy(model, seed: int) -> None:
    # Drawn on the model's device in its dtype: an 8B model must not pass through the CPU.
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    fp8 = [
        m
        for m in model.modules()
        if isinstance(m, Fp8Linear) or (isinstance(m, FusedMoE) and m.fp8_format is not None)
    ]
    done = {id(p) for m in fp8 for p in m.parameters(recurse=False)}
    for m in fp8:
        m.fill_random(gen, 0.05)
    for name, param in model.named_parameters():
        if id(param) in done:
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.05, 0.05, generator=gen)


def weight_files(model_path: Path) -> list[str]:
    """The checkpoint's safetensors files: those its index lists when it has one (a
    folder may hold other weights beside them, e.g. Mistral's consolidated.safetensors),
    else every *.safetensors in the folder."""
    index = Path(model_path) / "model.safetensors.index.json"
    if index.exists():
        listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in listed if not (Path(model_path) / f).exists()]
        if missing:
            raise ValueError(f"{index} lists {missing[:3]}, which the folder lacks")
        return [os.path.join(model_path, f) for f in listed]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path}")
    return files


def _load_safetensors(model, model_path: Path, quant: QuantConfig | None = None) -> None:
    files = weight_files(model_path)
    params = dict(model.named_parameters())
    expected = _expected_pieces(model, params)
    loaded: dict[str, set] = {name: set() for name in params}
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)  # checkpoints may omit unit norms; never leave garbage
    # FP8 expert weights wait for their scales (they may sit in another file), then are
    # dequantized into the stacked experts
    experts: dict[str, dict[str, torch.Tensor]] = {}
    padded = _padded_shapes(files, quant)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_SHAPE_ORIGINAL):
                    continue  # read by _padded_shapes
                tensor = f.get_tensor(name)
                if name in padded:  # a block-padded FP8 weight: its true rows and columns
                    rows, cols = padded.pop(name)
                    tensor = tensor[:rows, :cols]
                for target in _load_tensor(model, params, name, tensor, quant, experts):
                    loaded[target[0]].add(target[1])
    if padded:
        name = next(iter(padded)).removesuffix(".weight") + _SHAPE_ORIGINAL
        raise ValueError(f"checkpoint {model_path}: {name} has no weight beside it")
    if experts:
        for base, pair in experts.items():
            if set(pair) != {"weight", "scale"}:
                raise ValueError(
                    f"checkpoint {model_path}: FP8 weights and scales do not pair: {base} "
                    f"has only its {next(iter(pair))}"
                )
            deq = quant.dequantize(pair["weight"], pair["scale"], base)
            for target in _load_tensor(model, params, f"{base}.weight", deq, None, None):
                loaded[target[0]].add(target[1])
        log.warning(
            "%d FP8 MoE expert weights dequantized at load to the engine dtype (the "
            "fused MoE takes block experts only whose blocks tile H and I): they take "
            "that dtype's memory",
            len(experts),
        )
    missing = [
        name
        for name, pieces in expected.items()
        if not pieces <= loaded[name] and not name.endswith("norm.weight")
    ]
    if model.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        what = "weights or FP8 scales" if quant is not None else "weights"
        raise ValueError(f"checkpoint {model_path} lacks {what} for {missing[:5]}")


# compressed-tensors releases that padded block-quantized weights to whole blocks saved
# each such weight's true shape beside it (current ones store the weight truncated)
_SHAPE_ORIGINAL = ".weight_shape_original"


def _padded_shapes(files, quant: QuantConfig | None) -> dict[str, tuple[int, int]]:
    """The true (rows, columns) of each "<layer>.weight" the checkpoint stores padded
    (those with a <layer>.weight_shape_original), by weight name."""
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.endswith(_SHAPE_ORIGINAL):
                    continue
                if quant is None or (quant.method, quant.granularity) != (
                    "compressed-tensors",
                    "block",
                ):
                    raise ValueError(
                        f"{name}: a padded weight's shape, which compressed-tensors writes "
                        "for block-quantized weights only; this checkpoint's "
                        "quantization_config has no block compressed-tensors scheme"
                    )
                shape = f.get_tensor(name)
                if shape.dtype.is_floating_point or shape.shape != (2,) or shape.min() < 1:
                    raise ValueError(
                        f"{name}: {shape.tolist()} ({shape.dtype}) is not a weight's "
                        "[rows, columns]"
                    )
                rows, cols = (int(v) for v in shape.tolist())
                weight = name.removesuffix(_SHAPE_ORIGINAL) + ".weight"
                stored = f.get_slice(weight).get_shape() if weight in f.keys() else None
                if stored is not None and (
                    len(stored) != 2 or stored[0] < rows or stored[1] < cols
                ):
                    raise ValueError(
                        f"{name}: [{rows}, {cols}] does not fit in {weight} of shape {list(stored)}"
                    )
                shapes[weight] = (rows, cols)
    return shapes


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


def _load_tensor(
    model, params, name: str, tensor: torch.Tensor, quant: QuantConfig | None, experts
) -> list[tuple[str, object]]:
    """Copies one checkpoint tensor into its place; returns the (parameter, piece)s it
    filled. `experts` collects FP8 expert tensors to dequantize once paired."""
    if "rotary_emb.inv_freq" in name:
        return []
    if kv_scale_name(name) is not None:  # FP8 KV-cache scales: attention attributes
        load_kv_scale(model, name, tensor)
        return []
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return []
    original = name
    scale = bool(quant and quant.scale_suffix and name.endswith(quant.scale_suffix))
    if scale:  # routed like its weight
        name = name.removesuffix(quant.scale_suffix) + ".weight"
    elif tensor.dtype == FP8_DTYPE and quant is None:
        raise ValueError(
            f"{name} is float8_e4m3fn but config.json has no quantization_config: the "
            "scales are unknown"
        )
    for old, new in model.checkpoint_renames.items():
        name = name.replace(old, new)
    expert = _EXPERT.fullmatch(name)
    if expert and expert.group(3) in model.expert_modules:
        prefix, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        param, shard = model.expert_modules[proj]
        module = _submodule(model, prefix)
        if module is None or not hasattr(module, "load_expert") or index >= module.num_experts:
            raise ValueError(f"unexpected weight {original!r} in checkpoint")
        if fp8_format_of(module) is not None and quant.online and tensor.dtype != FP8_DTYPE:
            module.quantize_expert(param, index, shard, tensor)  # weight and its scales
            return [(f"{prefix}.{p}", (index, shard)) for p in (param, f"{param}_scale")]
        if fp8_format_of(module) is not None:  # FP8 experts: weights and scales as stored
            param = f"{param}_scale" if scale else param
        elif scale or tensor.dtype == FP8_DTYPE:  # dequantized once paired
            base = original.removesuffix(quant.scale_suffix if scale else ".weight")
            experts.setdefault(base, {})["scale" if scale else "weight"] = tensor
            return []
        module.load_expert(param, index, shard, tensor)
        return [(f"{prefix}.{param}", (index, shard))]
    target, shard, rows = name, None, None
    for ckpt_name, (fused, shard_id) in model.packed_modules.items():
        if f".{ckpt_name}." in name:
            target, shard = name.replace(ckpt_name, fused), shard_id
            break
    if target not in params:
        raise ValueError(f"unexpected weight {original!r} in checkpoint")
    layer_name, _, leaf = target.rpartition(".")
    layer = _submodule(model, layer_name)
    if target != name:  # a shard of a fused layer: its rows there (the layer knows them)
        rows = layer.shard_rows(shard)
    elif len(getattr(layer, "shards", {})) > 1 and not scale and tensor.dtype != FP8_DTYPE:
        # the checkpoint stores the fused layer whole (Phi-3's qkv_proj, gate_up_proj)
        return _load_fused_whole(layer, params[target], leaf, target, tensor, original)
    if layer is not None and fp8_format_of(layer) is not None and leaf == "weight":
        start, size = rows if rows is not None else (0, layer.out_features)
        if scale:
            per_tensor = quant.granularity == "tensor"
            tensor = layer.scale_slice(shard, tensor, per_tensor)  # this rank's scales
            layer.load_scale(tensor, start, size, original, per_tensor)
            return [(f"{layer_name}.weight_scale", shard)]
        if quant.online and tensor.dtype != FP8_DTYPE:  # takes its part after quantizing
            layer.quantize_rows(tensor, start, size, original, shard)
            return [(target, shard), (f"{layer_name}.weight_scale", shard)]
        tensor = layer.checkpoint_slice(leaf, shard, tensor)  # this rank's part
        layer.load_weight(tensor, start, size, original)
        return [(target, shard)]
    if scale or tensor.dtype == FP8_DTYPE:
        raise ValueError(
            f"{original} is an FP8 {'scale' if scale else 'weight'}, but the quantization "
            "config leaves its layer unquantized (ignore / modules_to_not_convert, or a layer "
            "that stays in full precision: embeddings, LM head, MoE router)"
        )
    slicer = getattr(layer, "checkpoint_slice", None)
    if slicer is not None:  # this rank's part (all of it without tensor parallelism)
        tensor = slicer(leaf, shard, tensor)
    if rows is not None:
        start, size = rows
        _copy(params[target].data[start : start + size], tensor, original)
    else:
        _copy(params[target].data, tensor, original)
    return [(target, shard)]


def _load_fused_whole(layer, param, leaf, target, tensor, original):
    """A fused layer's full-precision checkpoint tensor holding all its shards in order
    (q, k, v; gate, up): each shard's rows go where a separate checkpoint tensor's
    would, this rank's part of each under tensor parallelism."""
    sizes = list(layer.shards.values())
    if tensor.shape[0] != sum(sizes):
        raise ValueError(
            f"weight {original!r}: checkpoint shape {tuple(tensor.shape)}, the fused layer's "
            f"parts {dict(layer.shards)} add up to {sum(sizes)} rows"
        )
    filled = []
    for shard, part in zip(layer.shards, tensor.split(sizes, dim=0)):
        start, size = layer.shard_rows(shard)
        _copy(param.data[start : start + size], layer.checkpoint_slice(leaf, shard, part), original)
        filled.append((target, shard))
    return filled


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
