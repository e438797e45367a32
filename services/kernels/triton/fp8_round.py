"""Rounding onto the e4m3 grid in fp32, for Triton's interpreter (the CPU tests)."""

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
