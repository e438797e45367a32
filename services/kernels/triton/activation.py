"""SiLU-and-mul: x [..., 2I] -> silu(x[..., :I]) * x[..., I:].

Like torch (F.silu(gate) * up), silu's result is rounded to the input dtype before the
product, so low-precision outputs match the reference bit for bit in most elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    pdl_sync,
    rows_per_program,
    use_pdl,
)


@triton.jit
def silu_mul(gate, up, dtype):
    """silu(gate) * up rounded as torch rounds it: gate and up are dtype values (given in
    fp32), silu's result is rounded to dtype before the product, the product too."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def store_silu_mul(out_ptr, offs, mask, gate, up):
    """out[offs] = silu(gate) * up for fp32 sums of a gate_up linear's gate and up rows,
    each first rounded to out's dtype as the linear's output would be."""
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, silu_mul(gate, up, dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    inter,
    stride_xr,
    stride_xc,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < inter)[None, :]
    rows64 = rows.to(tl.int64)
    off = rows64[:, None] * stride_xr + cols[None, :] * stride_xc
    gate = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + off + inter * stride_xc, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * inter + cols[None, :], out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError("silu_and_mul needs an even last dim")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    n_rows = x2.shape[0]
    if n_rows == 0 or inter == 0:
        return out
    check_device(_silu_and_mul_kernel, x)
    interp = is_interpreted(_silu_and_mul_kernel)
    block_i = next_pow2(inter) if interp else min(1024, next_pow2(inter))
    block_r = rows_per_program(interp, n_rows, block_i)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(inter, block_i))
    pdl = use_pdl(x)
    _silu_and_mul_kernel[grid](
        x2, out, n_rows, inter, x2.stride(0), x2.stride(1), BLOCK_R=block_r, BLOCK_I=block_i,
        USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out
