"""The activation quantizer's cheap quotient (fp8_round.quantize_e4m3_by: one
reciprocal per group, then a multiply and an fma correction per element) gives the
same e4m3 values as the reference's correctly rounded division, including
quotients one ulp either side of every e4m3 rounding boundary. On a GPU this is the
fma path the GEMV runs; on the CPU the interpreter divides (its fma is not fused)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from services.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, quantize_activation  # noqa: E402
from services.kernels.triton._launch import is_interpreted  # noqa: E402
from services.kernels.triton.fp8_round import (  # noqa: E402
    activation_scale,
    quantize_e4m3_by,
    reciprocal_rn,
)

GROUP = 128


@triton.jit
def _quantize_groups(x_ptr, q_ptr, GROUP_: tl.constexpr, FP8_MAX_: tl.constexpr,
                     MIN_AMAX_: tl.constexpr, ROUND_IN_FP32: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * GROUP_ + tl.arange(0, GROUP_)
    x = tl.load(x_ptr + offs)
    s = activation_scale(tl.max(tl.abs(x), axis=0), MIN_AMAX_, FP8_MAX_)
    inv_s = reciprocal_rn(s)
    q = quantize_e4m3_by(x, s, inv_s, FP8_MAX_, ROUND_IN_FP32)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty))


def _boundary_groups(device) -> torch.Tensor:
    """Groups whose amax is fixed (so is their scale) and whose other 127 values sit
    at k ulps (k = -2..2) from midpoint * scale for every midpoint between adjacent
    positive e4m3 values, either sign: the quotients that straddle a rounding edge."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    groups = []
    for amax in (1.0, 3.7, 1e-3, 250.0, 5e-9):
        s = torch.tensor(amax, dtype=torch.float32) / torch.tensor(FP8_MAX)
        near = mids * s
        vals = [near]
        for k in (1, 2):
            up, down = near, near
            for _ in range(k):
                up = torch.nextafter(up, torch.tensor(float("inf")))
                down = torch.nextafter(down, torch.tensor(0.0))
            vals += [up, down]
        v = torch.cat(vals)
        v = torch.cat([v, -v])
        v = v[v.abs() < amax]
        pad = (-len(v)) % (GROUP - 1)
        v = torch.cat([v, v[:pad]]).view(-1, GROUP - 1)
        head = torch.full((v.shape[0], 1), amax)
        groups.append(torch.cat([head, v], dim=1))
    return torch.cat(groups).to(device)


def _random_groups(n, device, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, GROUP, generator=g) + 1.0
    exp = torch.randint(-40, 12, (n, 1), generator=g) + torch.randint(
        0, 16, (n, GROUP), generator=g
    )
    sign = torch.randint(0, 2, (n, GROUP), generator=g) * 2 - 1
    x = sign * mant * torch.pow(2.0, exp.float() - 8)
    x[::7] = x[::7].bfloat16().float()  # activations as bf16 rows deliver them
    x[3::11, ::5] = 0.0
    return x.to(device)


@pytest.mark.parametrize("kind", ["boundaries", "random"])
def test_cheap_quotient_equals_the_correctly_rounded_division(kind, device):
    n = 256 if device == "cpu" else 65536
    x = _boundary_groups(device) if kind == "boundaries" else _random_groups(n, device, 7)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
    interp = is_interpreted(_quantize_groups)
    _quantize_groups[(x.shape[0],)](
        x, q, GROUP_=GROUP, FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX, ROUND_IN_FP32=interp
    )
    ref, _ = quantize_activation(x.reshape(1, -1), GROUP)
    ref = ref.view(x.shape)
    same = q.float() == ref.float()  # values: the interpreter may round -tiny to +0
    assert same.all(), f"{(~same).sum().item()} of {same.numel()} differ, e.g. {x[~same][:4]}"
