"""Quantized checkpoints: which formats load, and how their tensors become weights.

Supported: block-wise FP8 as Qwen3-*-FP8 and DeepSeek-V3 ship it (config.json
`quantization_config: {quant_method: "fp8", weight_block_size: [128, 128]}`; each
quantized Linear stores `<name>.weight` in float8_e4m3fn and `<name>.weight_scale_inv`,
one float32 scale per block, dequantized = fp8 * scale). There are no FP8 GEMM kernels
yet: the weights are dequantized to the engine's dtype at load (said once in the log),
so they take that dtype's memory. Any other method is refused at start, by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SUPPORTED = "fp8 with weight_block_size (block-wise, as Qwen3-*-FP8 / DeepSeek-V3 ship)"
SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class BlockFP8:
    block_n: int  # output rows per scale
    block_k: int  # input columns per scale

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str):
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: expected float8_e4m3fn, the checkpoint has {weight.dtype}")
        rows, cols = weight.shape
        want = (-(-rows // self.block_n), -(-cols // self.block_k))
        if tuple(scale_inv.shape) != want:
            raise ValueError(
                f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, expected {want} for "
                f"a {rows} x {cols} weight in {self.block_n} x {self.block_k} blocks"
            )
        scale = scale_inv.float().repeat_interleave(self.block_n, 0)[:rows]
        scale = scale.repeat_interleave(self.block_k, 1)[:, :cols]
        return weight.float() * scale


def quantization_of(hf_config) -> BlockFP8 | None:
    """The checkpoint's quantization, or None for an unquantized one. Raises ValueError
    naming the method for anything not supported."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method == "fp8" and block:
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"quantization_config.weight_block_size {block!r} is not [n, k]")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme {quant['activation_scheme']!r} is "
                "not supported (dynamic only)"
            )
        return BlockFP8(int(block[0]), int(block[1]))
    what = f"quant_method {method!r}" + (" without weight_block_size" if method == "fp8" else "")
    raise ValueError(
        f"quantization_config with {what} (config.json) is not supported; supported: "
        f"unquantized bfloat16 / float16 / float32 checkpoints, and {SUPPORTED}"
    )
