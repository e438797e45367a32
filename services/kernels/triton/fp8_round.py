"""The activation quantization steps every pdserve FP8 kernel shares (the reference is
services/kernels/fp8.py's quantize_activation): the scale from an amax, and x / scale
on the e4m3 grid. Quotients are correctly rounded, as torch's quantizer divides:
Triton's `/` on fp32 is an approximate divide on NVIDIA, and a quotient one ulp off can
land on the other side of an e4m3 rounding boundary. div_rn gives them one division at
a time; quantize_e4m3_by gives the same values from one reciprocal per scale."""

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(v):
    """v (fp32, within +-448) rounded to nearest even on the e4m3 grid, still in fp32:
    3 mantissa bits in the normal range (>= 2^-6), steps of 2^-9 below. For the
    interpreter only: its float32 -> float8e4nv cast mis-rounds (a carry into the next
    binade is dropped: 31.6 becomes 16; subnormals truncate), while the cast of a value
    already on the grid is exact."""
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # the subnormal step 2^-9 = 2^(-6 - 3)
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2^23 ulps: adding it rounds v to a multiple of ulp
    return (v + magic) - magic


@triton.jit
def activation_scale(amax, MIN_AMAX: tl.constexpr, FP8_MAX_: tl.constexpr):
    """The symmetric scale for values up to amax: amax / the type's max (never 0)."""
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX_)


@triton.jit
def quantize_e4m3(x, scale, FP8_MAX_: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x / scale saturated to the type's range, still fp32: a cast to the FP8 type then
    rounds it (on the interpreter it is rounded here first: round_to_e4m3)."""
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
    if ROUND_IN_FP32:
        q = round_to_e4m3(q)
    return q


@triton.jit
def reciprocal_rn(scale):
    """1 / scale correctly rounded: quantize_e4m3_by's inv_scale."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def quantize_e4m3_by(x, scale, inv_scale, FP8_MAX_: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """quantize_e4m3 for many x per scale, with inv_scale = reciprocal_rn(scale) computed
    once: q0 = x * inv_scale is within an ulp of x / scale, and one step with the
    exact remainder (an fma) makes it the correctly rounded quotient (Markstein's
    theorem): three instructions where div_rn takes about eight and a branch. Equal to
    quantize_e4m3 for every finite x: the theorem needs the remainder free of
    underflow, which holds wherever x / scale can round to a nonzero e4m3 value (scale
    >= MIN_AMAX / 448 keeps such x above 2^-70). ROUND_IN_FP32 (the interpreter) divides
    as quantize_e4m3 does: numpy's fma rounds the product first."""
    if ROUND_IN_FP32:
        return quantize_e4m3(x, scale, FP8_MAX_, ROUND_IN_FP32)
    q0 = x * inv_scale
    rem = tl.math.fma(-q0, scale, x)
    return tl.clamp(tl.math.fma(rem, inv_scale, q0), -FP8_MAX_, FP8_MAX_)
