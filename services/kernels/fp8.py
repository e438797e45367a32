"""FP8 linear layers as the kernels see them, and the reference math every FP8 kernel
is tested against.

A quantized linear (services/models/fp8_linear.py) holds `weight` in float8_e4m3fn
[N, K], `weight_scale` in float32 and its `fp8_format` (an Fp8Format, below), which
says how the scale maps onto the weight: dequantized weight = fp8 * scale, with one
scale per `block_n x block_k` block ("block": [ceil(N/bn), ceil(K/bk)], as DeepSeek-V3
and Qwen3-*-FP8 ship), per output row ("channel": [N]) or one for all ("tensor": a
0-dim tensor). Activations are quantized dynamically at every call, symmetric, to
e4m3 with scale = amax / 448: per token and per `block_k` group of K for block
weights (as DeepSeek-V3 / vLLM's w8a8 block-FP8 do), per token over all of K for
channel and tensor weights (compressed-tensors FP8_DYNAMIC, online quantization). So a
matmul is W8A8: every kernel, and the reference here, compute
sum_k (x_q * x_scale)(w_q * w_scale) in fp32 and round the result to x's dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The smallest amax a scale is made from: an all-zero row quantizes to zeros, not NaN.
_MIN_AMAX = 1e-12
GRANULARITIES = ("block", "channel", "tensor")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8Format:
    """How an FP8 linear's `weight_scale` covers its weight (see the module doc)."""

    granularity: str
    block_n: int = 0  # block only: output rows per scale
    block_k: int = 0  # block only: input columns per scale (and per activation group)

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"FP8 granularity must be one of {GRANULARITIES}, not {self.granularity!r}"
            )
        blocked = self.granularity == "block"
        if blocked and not (self.block_n > 0 and self.block_k > 0):
            raise ValueError(
                f"block FP8 needs positive block sizes, got {self.block_n} x {self.block_k}"
            )
        if not blocked and (self.block_n or self.block_k):
            raise ValueError(f"{self.granularity} FP8 has no block sizes")

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.granularity == "block":
            return (cdiv(n, self.block_n), cdiv(k, self.block_k))
        return (n,) if self.granularity == "channel" else ()

    def act_group(self, k: int) -> int:
        """Columns of x that share one activation scale (per token)."""
        return self.block_k if self.granularity == "block" else k


def fp8_format_of(layer) -> Fp8Format | None:
    """The layer's Fp8Format, None for an unquantized nn.Linear. Read from the instance
    dict: a miss through nn.Module.__getattr__ would raise and catch on every call."""
    return layer.__dict__.get("fp8_format")


# ---- the reference (torch ops; CPU and GPU) --------------------------------------------
def quantize_activation(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, ceil(K / group)]), symmetric,
    scale = amax / 448 per row and group of `group` columns."""
    m, k = x.shape
    groups = cdiv(k, group)
    xf = x.float()
    if groups * group != k:  # zero-pad the last group (zeros change no amax)
        xf = torch.nn.functional.pad(xf, (0, groups * group - k))
    xg = xf.view(m, groups, group)
    scale = xg.abs().amax(dim=-1).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    k = q.shape[1]
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp8 [N, K] and its scales -> fp32 [N, K]."""
    if fmt.granularity == "block":
        n, k = weight.shape
        full = scale.float().repeat_interleave(fmt.block_n, 0)[:n]
        full = full.repeat_interleave(fmt.block_k, 1)[:, :k]
        return weight.float() * full
    if fmt.granularity == "channel":
        return weight.float() * scale.float().unsqueeze(1)
    return weight.float() * scale.float()


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision [N, K] weight -> (float8_e4m3fn [N, K], fp32 [N]): one symmetric
    scale per output row (online quantization, `quantization="fp8"`)."""
    wf = weight.float()
    scale = wf.abs().amax(dim=1).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (wf / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear_reference(x: torch.Tensor, layer) -> torch.Tensor:
    """x @ dequant(W).T + bias with x quantized as the kernels quantize it, all in fp32,
    rounded to x's dtype once: the yardstick for every FP8 GEMM."""
    fmt = fp8_format_of(layer)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    group = fmt.act_group(k)
    xq, xs = quantize_activation(x2, group)
    out = (
        dequantize_activation(xq, xs, group)
        @ dequantize_weight(layer.weight, layer.weight_scale, fmt).t()
    )
    if layer.bias is not None:
        out = out + layer.bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
