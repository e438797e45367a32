"""FP8 linears through cuBLASLt: `torch._scaled_mm`. A candidate the kernel tuner
times for FP8 models (per token class); every other op, and unquantized linears, are
the torch backend's.

Activations are quantized by pdserve's Triton quantizer (one kernel) as the weight's
format says, then one scaled GEMM:
- channel and tensor weights, bfloat16 models: row-wise scaling, scale_a [M, 1] (per
  token) x scale_b [1, N] (per channel; a tensor scale repeated), fp32 accumulation,
  bf16 out;
- channel and tensor weights, other dtypes (row-wise scaling writes bf16 only): a
  per-tensor scaled GEMM into fp32 whose output rows and columns are then multiplied
  by the two scales;
- 128 x 128 block weights (Qwen3-*-FP8, DeepSeek-V3), bfloat16 models: cuBLASLt's
  block scaling (CUDA 12.9+): activations in 1 x 128 groups, scale_a [M, K/128] stored
  column-major, x the weight's 128 x 128 scales, scale_b [K/128, N/128] (the
  checkpoint's `weight_scale_inv` transposed, its rows padded to a multiple of 4).
  Other block sizes and dtypes are a ValueError (the triton and aiter candidates
  compute them); a torch or CUDA without block scaling fails the candidate's first
  call, and the tuner drops it.
cuBLASLt wants every dimension a multiple of 16: M is padded (decode rows; measured on
the H200: a padded one-row 8192 x 28672 projection still reads its FP8 weight at 3.9
TB/s), K and N must be. Needs an NVIDIA GPU with FP8 tensor cores (sm_89+: Ada,
Hopper, Blackwell); refused at construction elsewhere. No host syncs: capturable."""

from __future__ import annotations

import torch

from services.kernels.fp8 import fp8_format_of
from services.kernels.torch_backend import TorchBackend

_ALIGN = 16
_BLOCK = 128


class ScaledMMBackend(TorchBackend):
    name = "scaled_mm"

    def __init__(self, device: torch.device | str | None = None):
        if getattr(torch.version, "hip", None) is not None:
            raise ValueError("the scaled_mm FP8 candidate is checked on NVIDIA GPUs only")
        if not torch.cuda.is_available():
            raise ValueError("the scaled_mm FP8 candidate needs a CUDA GPU")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"the scaled_mm FP8 candidate needs FP8 tensor cores (sm_89+), this GPU is "
                f"sm_{cap[0]}{cap[1]}"
            )
        try:  # lazy: the per-token quantizer is a Triton kernel
            from services.kernels.triton.fp8_gemm import quantize_activation
        except ImportError as exc:
            raise ValueError(f"the scaled_mm FP8 candidate needs triton ({exc})") from exc
        self._quantize = quantize_activation
        self._one = {}

    def linear(self, x, layer):
        fmt = fp8_format_of(layer)
        if fmt is None:
            return super().linear(x, layer)
        weight = layer.weight  # [N, K]; .t() is the column-major [K, N] cuBLASLt wants
        n, k = weight.shape
        if k % _ALIGN or n % _ALIGN:
            raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got {k} x {n}")
        if fmt.granularity == "block":
            out = self._block_linear(x.reshape(-1, k), layer, fmt)
        else:
            out = self._scaled_linear(x.reshape(-1, k), layer, fmt)
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], n)

    def _scaled_linear(self, x2, layer, fmt):
        weight = layer.weight
        n, k = weight.shape
        m = x2.shape[0]
        xq, xs = self._quantize(x2, k, weight.dtype, rows=m + (-m % _ALIGN))
        if x2.dtype == torch.bfloat16:
            out = torch._scaled_mm(
                xq,
                weight.t(),
                scale_a=xs,
                scale_b=_row_scale(layer, n),
                out_dtype=torch.bfloat16,
            )
            return out[:m]
        one = self._one.get(x2.device)
        if one is None:
            one = self._one[x2.device] = torch.ones((), dtype=torch.float32, device=x2.device)
        per_tensor = layer.weight_scale if fmt.granularity == "tensor" else one
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=one, scale_b=per_tensor, out_dtype=torch.float32
        )
        out = out[:m] * xs[:m]
        if fmt.granularity == "channel":
            out = out * layer.weight_scale
        return out.to(x2.dtype)

    def _block_linear(self, x2, layer, fmt):
        if (fmt.block_n, fmt.block_k) != (_BLOCK, _BLOCK):
            raise ValueError(
                f"cuBLASLt block scaling takes 128 x 128 weight blocks, not "
                f"{fmt.block_n} x {fmt.block_k}: the triton or aiter candidates run these"
            )
        if x2.dtype != torch.bfloat16:
            raise ValueError(f"cuBLASLt block-scaled FP8 writes bfloat16 only, not {x2.dtype}")
        weight = layer.weight
        n, k = weight.shape
        if k % _BLOCK or n % _BLOCK:
            raise ValueError(
                f"cuBLASLt block scaling needs K and N multiples of 128, got {k} x {n}"
            )
        m = x2.shape[0]
        xq, xs = self._quantize(
            x2, _BLOCK, weight.dtype, rows=m + (-m % _ALIGN), column_major_scales=True
        )
        out = torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=xs,
            scale_b=_block_scale(layer),
            out_dtype=torch.bfloat16,
        )
        return out[:m]


def _row_scale(layer, n: int) -> torch.Tensor:
    """The weight's scales as the [1, N] fp32 row row-wise scaling reads; built once per
    layer (weights never change after loading)."""
    row = layer.__dict__.get("_scaled_mm_row_scale")
    if row is None:
        row = layer.weight_scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
        layer.__dict__["_scaled_mm_row_scale"] = row
    return row


def _block_scale(layer) -> torch.Tensor:
    """The [N/128, K/128] block scales as the [K/128, N/128] column-major operand block
    scaling reads, the leading dimension padded to a multiple of 4; built once."""
    scale = layer.__dict__.get("_scaled_mm_block_scale")
    if scale is None:
        blocks_n, blocks_k = layer.weight_scale.shape
        padded = layer.weight_scale.new_zeros((blocks_n, blocks_k + (-blocks_k % 4)))
        padded[:, :blocks_k] = layer.weight_scale.float()
        scale = padded[:, :blocks_k].t()
        layer.__dict__["_scaled_mm_block_scale"] = scale
    return scale
