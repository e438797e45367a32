"""FP8 linears through cuBLASLt: `torch._scaled_mm`. A candidate the kernel tuner
times for FP8 models (per token class); every other op, and unquantized linears, are
the torch backend's.

Channel and tensor weights only (cuBLASLt takes per-tensor and row-wise scales; block
weights are a ValueError: the triton and aiter candidates compute those). Activations
are quantized per token by pdserve's Triton quantizer (one kernel), then:
- bfloat16 models: one row-wise scaled GEMM, scale_a [M, 1] (per token) x scale_b
  [1, N] (per channel; a tensor scale repeated), fp32 accumulation, bf16 out;
- other dtypes (row-wise scaling writes bf16 only): a per-tensor scaled GEMM into fp32
  whose output rows and columns are then multiplied by the two scales.
cuBLASLt wants every dimension a multiple of 16: M is padded (decode rows; measured on
the H200: a padded one-row 8192 x 28672 projection still reads its FP8 weight at 3.9
TB/s), K and N must be. Needs an NVIDIA GPU with FP8 tensor cores (sm_89+: Ada,
Hopper, Blackwell); refused at construction elsewhere. No host syncs: capturable."""

from __future__ import annotations

import torch

from services.kernels.fp8 import fp8_format_of
from services.kernels.torch_backend import TorchBackend

_ALIGN = 16


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
        if fmt.granularity == "block":
            raise ValueError(
                "torch._scaled_mm takes per-tensor and row-wise scales, not block scales: "
                "block FP8 weights run on the triton or aiter candidates"
            )
        weight = layer.weight  # [N, K]; .t() is the column-major [K, N] cuBLASLt wants
        n, k = weight.shape
        if k % _ALIGN or n % _ALIGN:
            raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got {k} x {n}")
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, xs = self._quantize(x2, k, weight.dtype)  # per token: xs [M, 1]
        pad = -m % _ALIGN
        if pad:
            padded = torch.zeros((m + pad, k), dtype=xq.dtype, device=x.device)
            padded[:m] = xq
            xq = padded
            xs = torch.cat([xs, xs.new_ones(pad, 1)])
        if x.dtype == torch.bfloat16:
            out = torch._scaled_mm(
                xq,
                weight.t(),
                scale_a=xs,
                scale_b=_row_scale(layer, n),
                out_dtype=torch.bfloat16,
            )
            out = out[:m]
        else:
            one = self._one.get(x.device)
            if one is None:
                one = self._one[x.device] = torch.ones((), dtype=torch.float32, device=x.device)
            per_tensor = layer.weight_scale if fmt.granularity == "tensor" else one
            out = torch._scaled_mm(
                xq, weight.t(), scale_a=one, scale_b=per_tensor, out_dtype=torch.float32
            )
            out = out[:m] * xs[:m]
            if fmt.granularity == "channel":
                out = out * layer.weight_scale
            out = out.to(x.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], n)


def _row_scale(layer, n: int) -> torch.Tensor:
    """The weight's scales as the [1, N] fp32 row row-wise scaling reads; built once per
    layer (weights never change after loading)."""
    row = layer.__dict__.get("_scaled_mm_row_scale")
    if row is None:
        row = layer.weight_scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
        layer.__dict__["_scaled_mm_row_scale"] = row
    return row
