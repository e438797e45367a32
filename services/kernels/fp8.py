"""FP8 linear layers as the kernels see them, and the reference math every FP8 kernel
is tested against.

A quantized linear (services/models/fp8_linear.py) holds `weight` in FP8 e4m3 [N, K]
(float8_e4m3fn, or fnuz where the platform needs it: below), `weight_scale` in
float32 and its `fp8_format` (an Fp8Format, below), which says how the scale maps
onto the weight: dequantized weight = fp8 * scale, with one scale per `block_n x
block_k` block ("block": [ceil(N/bn), ceil(K/bk)], as DeepSeek-V3 and Qwen3-*-FP8
ship), per output row ("channel": [N]) or one for all ("tensor": a 0-dim tensor).
Activations are quantized dynamically at every call, symmetric, to the weight's e4m3
type with scale = amax / its max (448 for fn): per token and per `block_k` group of K
for block weights (as DeepSeek-V3 / vLLM's w8a8 block-FP8 do), per token over all of
K for channel and tensor weights (compressed-tensors FP8_DYNAMIC, online
quantization). So a matmul is W8A8: every kernel, and the reference here, compute
sum_k (x_q * x_scale)(w_q * w_scale) in fp32 and round the result to x's dtype.

Which e4m3: checkpoints store OCP float8_e4m3fn (max 448), and so does every NVIDIA GPU
and MI350; AMD's MI300 (gfx94x) computes in float8_e4m3fnuz (exponent bias 8, not 7:
the same bits mean half the value, max 240; no -0, whose bits 0x80 are its only NaN).
`platform_fp8_dtype` decides which, once, for a device; the loader converts an fn
checkpoint to fnuz there (`fn_to_fnuz`: the same bits, 0x80 -> 0, scales doubled, so
weight * scale is unchanged) and activations are quantized to the weight's type with
that type's max (240 for fnuz), as vLLM does on ROCm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn  # checkpoints' (OCP e4m3)
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_FNUZ_DTYPE = torch.float8_e4m3fnuz  # MI300's (gfx94x): max 240
FP8_DTYPES = (FP8_DTYPE, FP8_FNUZ_DTYPE)
# The smallest amax a scale is made from: an all-zero row quantizes to zeros, not NaN.
MIN_AMAX = 1e-12
GRANULARITIES = ("block", "channel", "tensor")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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


@dataclass(frozen=True, eq=False)
class Fp8Experts:
    """A MoE layer's FP8 experts as fused_moe reads them: w13 [E, 2I, H] and w2 [E, H, I]
    in FP8 (passed as fused_moe's weights) with these scales (dequantized = fp8 *
    scale), by fmt:
    - block (block_n x block_k blocks, which tile H and I: `experts_fit_fp8`):
      w13_scale [E, 2I / bn, H / bk] (the gate rows' blocks, then the up rows'),
      w2_scale [E, H / bn, I / bk]; activations quantized per token and block_k group
      at each expert GEMM's input, as for a block linear;
    - channel (one scale per output row; a per-tensor checkpoint's scale repeated):
      w13_scale [E, 2I], w2_scale [E, H]; activations quantized per token over the
      whole row, as for a channel linear."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    fmt: Fp8Format


def expert_scale_shapes(fmt: Fp8Format, e: int, h: int, inter: int) -> tuple[tuple, tuple]:
    """The (w13_scale, w2_scale) shapes E experts of these sizes have in fmt."""
    if fmt.granularity == "block":
        return (
            (e, 2 * inter // fmt.block_n, h // fmt.block_k),
            (e, h // fmt.block_n, inter // fmt.block_k),
        )
    return (e, 2 * inter), (e, h)


def experts_fit_fp8(fmt: Fp8Format | None, hidden: int, intermediate: int) -> bool:
    """Whether MoE experts of these sizes can stay in FP8: channel experts always; block
    ones whose blocks tile H and I (this rank's) exactly, so the gate and up halves of
    w13 never share a scale block (every published block-FP8 MoE: Qwen3-30B-A3B H 2048
    / I 768, DeepSeek-V3 7168 / 2048)."""
    if fmt is None or fmt.granularity == "tensor":
        return False
    if fmt.granularity == "channel":
        return True
    return all(d % b == 0 for d in (hidden, intermediate) for b in (fmt.block_n, fmt.block_k))


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 type: 448 for e4m3fn, 240 for e4m3fnuz."""
    return torch.finfo(dtype).max


def fp8_dtype_for_arch(gcn_arch: str | None) -> torch.dtype:
    """The e4m3 type a GPU computes in, from its ROCm architecture name (None: not a
    ROCm device): float8_e4m3fnuz on gfx94x (MI300 series), float8_e4m3fn everywhere
    else (NVIDIA, MI350's gfx950 and later, the CPU)."""
    return FP8_FNUZ_DTYPE if gcn_arch and gcn_arch.startswith("gfx94") else FP8_DTYPE


def platform_fp8_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The FP8 weight (and KV-cache) type for `device`: the one place that decides."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or getattr(torch.version, "hip", None) is None:
        return FP8_DTYPE
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fp8_dtype_for_arch(torch.cuda.get_device_properties(index).gcnArchName)


def fn_to_fnuz(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float8_e4m3fn weight and its scales as float8_e4m3fnuz ones with the same
    dequantized values: the same bits (worth half as much in fnuz), except 0x80 (-0 in
    fn, NaN in fnuz) which becomes 0, and scales doubled (exact: a power of two)."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fn_to_fnuz converts float8_e4m3fn, not {weight.dtype}")
    bits = weight.view(torch.int8)
    bits = bits.masked_fill(bits == -128, 0)
    return bits.view(FP8_FNUZ_DTYPE), None if scale is None else scale * 2


def fp8_format_of(layer) -> Fp8Format | None:
    """The layer's Fp8Format, None for an unquantized nn.Linear. Read from the instance
    dict: a miss through nn.Module.__getattr__ would raise and catch on every call."""
    return layer.__dict__.get("fp8_format")


# ---- the reference (torch ops; CPU and GPU) --------------------------------------------
def _div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor correctly rounded on every device, as the kernels divide (div_rn).
    On CUDA, torch divides by a Python number as a multiplication by its reciprocal,
    which can be one ulp off; a scale one ulp off moves an activation across an e4m3
    rounding boundary now and then (measured: one or two of 4096 per row, 3e-4 of a
    GEMV's output on an H200)."""
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)


def quantize_activation(
    x: torch.Tensor, group: int, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 `dtype` [M, K], fp32 scales [M, ceil(K / group)]), symmetric,
    scale = amax / max(dtype) (448, or 240 for fnuz) per row and group of `group`
    columns."""
    top = fp8_max(dtype)
    m, k = x.shape
    groups = cdiv(k, group)
    xf = x.float()
    if groups * group != k:  # zero-pad the last group (zeros change no amax)
        xf = torch.nn.functional.pad(xf, (0, groups * group - k))
    xg = xf.view(m, groups, group)
    scale = _div(xg.abs().amax(dim=-1).clamp_min(MIN_AMAX), top)
    q = (xg / scale.unsqueeze(-1)).clamp(-top, top).to(dtype)
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


def quantize_weight_per_channel(
    weight: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision [N, K] weight -> (FP8 `dtype` [N, K], fp32 [N]): one symmetric
    scale per output row (online quantization, `quantization="fp8"`)."""
    top = fp8_max(dtype)
    wf = weight.float()
    scale = _div(wf.abs().amax(dim=1).clamp_min(MIN_AMAX), top)
    q = (wf / scale.unsqueeze(1)).clamp(-top, top).to(dtype)
    return q, scale


def fp8_linear_reference(x: torch.Tensor, layer) -> torch.Tensor:
    """x @ dequant(W).T + bias with x quantized as the kernels quantize it, all in fp32,
    rounded to x's dtype once: the yardstick for every FP8 GEMM."""
    return _fp8_matmul(x, layer.weight, layer.weight_scale, fp8_format_of(layer), layer.bias)


def _fp8_matmul(x, weight, scale, fmt: Fp8Format, bias=None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    group = fmt.act_group(k)
    xq, xs = quantize_activation(x2, group, weight.dtype)  # fn or fnuz, as W
    out = dequantize_activation(xq, xs, group) @ dequantize_weight(weight, scale, fmt).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def fused_moe_fp8_reference(x, weights, ids, w13, w2, fp8: Fp8Experts, silu_and_mul):
    """The FP8 experts' reference, given the routing (weights [T, top_k] in x's dtype,
    ids [T, top_k]): per expert, its tokens through two FP8 linears of fp8.fmt (each
    input quantized as that format says, fp32 products, rounded to x's dtype) with
    silu_and_mul between, weighted and summed in expert order (host syncs: eager)."""
    fmt = fp8.fmt
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate_up = _fp8_matmul(x[token], w13[e], fp8.w13_scale[e], fmt)
        down = _fp8_matmul(silu_and_mul(gate_up), w2[e], fp8.w2_scale[e], fmt)
        out.index_add_(0, token, down * weights[token, slot, None])
    return out
