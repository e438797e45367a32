"""FP8 checkpoints: which of a model's layers the quantization config covers, swapped
for FP8 ones on the meta device before any memory is allocated (loader.load_model)."""

from __future__ import annotations

import logging

import torch

from services.kernels.fp8 import experts_fit_fp8
from services.models.fp8_linear import Fp8Linear
from services.models.layers import Linear, ParallelLMHead
from services.models.moe import FusedMoE
from services.models.quantization import QuantConfig

log = logging.getLogger(__name__)


def _checkpoint_names(model, ours: str) -> list[str]:
    """The checkpoint's module names for our module `ours` (a fused one has several)."""
    for old, new in model.checkpoint_renames.items():
        ours = ours.replace(new, old)
    prefix, _, leaf = ours.rpartition(".")
    shards = [ckpt for ckpt, (fused, _) in model.packed_modules.items() if fused == leaf]
    return [f"{prefix}.{s}" for s in shards] if shards else [ours]


def use_fp8_layers(model, quant: QuantConfig, fp8_dtype: torch.dtype) -> None:
    """Swap the Linears the quantization covers for Fp8Linears, and keep the MoE
    experts in FP8 where the fused MoE takes them (on the meta device)."""
    # MoE routers and shared-expert gates stay in full precision (as vLLM keeps them)
    routers = {
        id(gate)
        for m in model.modules()
        if isinstance(m, FusedMoE)
        for gate in (m.gate, m.shared_expert_gate)
        if gate is not None
    }
    swapped = 0
    for name, module in list(model.named_modules()):
        if (
            not isinstance(module, Linear)
            or isinstance(module, ParallelLMHead)
            or id(module) in routers
        ):
            continue
        names = _checkpoint_names(model, name)
        if not quant.quantizes(names, name):
            continue
        fmt = quant.layer_format(fused=len(names) > 1)
        leaf = name.rpartition(".")[2]
        if fmt.granularity == "block" and len(names) > 1:
            for ckpt in names:
                start, _ = module.shard_rows(model.packed_modules[ckpt.rpartition(".")[2]][1])
                if start % fmt.block_n:
                    # a shard starting inside a scale block would share it with another
                    raise ValueError(
                        f"quantization_config.{quant.block_key} [{fmt.block_n}, "
                        f"{fmt.block_k}]: {ckpt} starts at row {start} of the fused {name}, "
                        "not on a block boundary"
                    )
        parent = model.get_submodule(name.rpartition(".")[0])
        setattr(parent, leaf, Fp8Linear.replacing(module, fmt, fp8_dtype, quant.block_key))
        swapped += 1
    if swapped == 0:
        raise ValueError(
            f"quantization_config ({quant.method}) quantizes no layer of this model: check "
            "its targets / ignore"
        )
    log.info(
        "%s: %d linear layers kept in FP8 (%s, %s scales)",
        quant.method,
        swapped,
        fp8_dtype,
        quant.granularity,
    )
    _use_fp8_experts(model, quant, fp8_dtype)


def _use_fp8_experts(model, quant: QuantConfig, fp8_dtype: torch.dtype) -> None:
    """Keep MoE experts in FP8 where the fused MoE computes them: channel- and
    tensor-scaled checkpoints (as channel) and online quantization (channel, quantized
    as they load), block ones whose blocks tile H and this rank's I. Others (odd block
    sizes) keep their experts in the engine dtype, said once."""
    fmt = quant.layer_format(fused=True)
    kept, full = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        names = [_checkpoint_names(model, f"{name}.experts.0.{p}")[0] for p in model.expert_modules]
        if not quant.quantizes(names, f"{name}.experts"):
            continue
        h = module.w13.shape[2]
        if experts_fit_fp8(fmt, h, module.intermediate_size):
            module.use_fp8(fmt, fp8_dtype)
            kept += 1
        else:
            full.append(name)
    if kept:
        log.info("%d MoE layers keep their experts in FP8 (%s, %s)", kept, fp8_dtype, fmt)
    if full:  # visible: the experts are most of an MoE model's memory
        log.warning(
            "%d MoE layers keep their experts in the engine dtype (the fused MoE takes "
            "block-FP8 experts whose blocks tile H and I, not %s): they take that "
            "dtype's memory",
            len(full),
            fmt,
        )
