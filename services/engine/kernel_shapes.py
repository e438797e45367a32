"""What the kernel tuner measures for an engine: the model's shapes for one
tensor-parallel rank, its dtypes, KV cache dtype, FP8 weight format and whether its MoE
experts stay FP8, from the engine config and the checkpoint's config alone (the tuner
runs before the weights load)."""

from __future__ import annotations

import dataclasses

from services.kernels.fp8 import experts_fit_fp8
from services.kernels.shape_classes import KernelShapes, weight_quant_tag
from services.models.quantization import quantization_of


def kernel_shapes(config, hf_config) -> KernelShapes:
    """What the kernel tuner measures for this engine config and model: one rank's
    shapes, dtypes, KV cache dtype and FP8 weight format."""
    quant = quantization_of(hf_config, config.quantization)
    # the unfused layers' format: a per-tensor checkpoint's fused qkv / gate_up are
    # per-channel, the same kernels with a row of scales
    fmt = quant.layer_format(fused=False) if quant is not None else None
    shapes = KernelShapes.from_hf_config(
        hf_config,
        config.block_size,
        config.torch_dtype_name,
        kv_cache_dtype="fp8_e4m3" if config.kv_cache_fp8 else "auto",
        weight_quant=weight_quant_tag(fmt),
        tp_size=config.tensor_parallel_size,
    )
    # the loader's rule (fp8_swap._use_fp8_experts), less its check that the checkpoint
    # quantizes the experts at all: every published FP8 MoE does
    fp8_experts = (
        quant is not None
        and shapes.num_experts > 0
        and experts_fit_fp8(
            shapes.expert_fp8_format(), shapes.hidden_size, shapes.moe_intermediate_size
        )
    )
    return dataclasses.replace(shapes, fp8_experts=fp8_experts) if fp8_experts else shapes
