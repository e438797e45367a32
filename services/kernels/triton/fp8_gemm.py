"""pdserve's FP8 GEMM: out = dequant(quant(x)) @ dequant(W).T (+ bias) for an FP8
linear layer (services/kernels/fp8.py says what the formats mean).

Two kernels:
- `quantize_activation`: x [M, K] -> FP8 [M, K] (the weight's e4m3 type: fn, or fnuz
  on MI300) and fp32 scales [M, G], one symmetric scale (amax / the type's max: 448,
  240 for fnuz) per token and group of GROUP columns: 128-column groups
  for block weights (DeepSeek-V3's and vLLM's w8a8 block-FP8 activation scheme), the
  whole row for channel / tensor weights. Grid (M, G); a program walks its group in
  chunks twice (amax, then quantize), so any K fits in registers.
- `fp8_gemm`: tiles [BLOCK_M, BLOCK_N] of the output, walking K in BLOCK_K steps with
  FP8 tensor-core dots accumulated in fp32. Block weights: each K step lies inside one
  scale block (BLOCK_K divides block_k), so the step's dot is scaled by its activation
  scale (per row) and weight scale (per column: column n reads block n // block_n)
  before it is added. Channel / tensor weights: the dots sum unscaled and the epilogue
  multiplies by the row's activation scale and the column's weight scale (a tensor
  scale is read with column stride 0). Then bias, and the cast to the output dtype.

Both are plain launches with shape-only sizes (no host syncs, no atomics): safe to
capture in CUDA graphs. Runs under TRITON_INTERPRET=1 on a CPU (the interpreter handles
float8_e4m3fn loads, stores and dots, not fnuz ones), which is how the CPU tests run it.
Launch settings for up to 64 rows come from an H200 sweep (`benchmarks/fp8_gemv_bench.py`);
larger batches keep a first guess (128 x 128 x 128 tiles), not tuned yet."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.fp8 import FP8_DTYPE, MIN_AMAX, Fp8Format, fp8_max
from services.kernels.triton import fp8_gemv
from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    pdl_sync,
    use_pdl,
)
from services.kernels.triton.fp8_round import activation_scale, quantize_e4m3


@triton.jit
def _quant_act_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * GROUP
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        cols = start + c + tl.arange(0, CHUNK)
        mask = (cols < K) & (c + tl.arange(0, CHUNK) < GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = activation_scale(tl.max(amax, axis=0), MIN_AMAX, FP8_MAX_)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
    for c in range(0, GROUP, CHUNK):
        cols = start + c + tl.arange(0, CHUNK)
        mask = (cols < K) & (c + tl.arange(0, CHUNK) < GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = quantize_e4m3(x, scale, FP8_MAX_, ROUND_IN_FP32)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_activation(
    x: torch.Tensor,
    group: int,
    dtype: torch.dtype = FP8_DTYPE,
    rows: int | None = None,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (FP8 `dtype` [R, K], fp32 [R, ceil(K / group)]).
    R = rows (default M): rows past M are zeros with scale 1, the padding cuBLASLt
    wants. column_major_scales: the scales' storage is [G, R] transposed (stride (1, R)),
    the layout cuBLASLt's 1 x 128 block scaling reads."""
    check_device(_quant_act_kernel, x)
    m, k = x.shape
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"rows ({rows}) must be at least the {m} rows of x")
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    if column_major_scales:
        s = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows > m:
        q[m:].zero_()
        s[m:].fill_(1.0)
    if m == 0:
        return q, s
    chunk = min(next_pow2(group), 4096 if is_interpreted(_quant_act_kernel) else 1024)
    pdl = use_pdl(x)
    _quant_act_kernel[(m, groups)](
        x,
        q,
        s,
        k,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        GROUP=group,
        CHUNK=chunk,
        FP8_MAX_=fp8_max(dtype),
        MIN_AMAX=MIN_AMAX,
        ROUND_IN_FP32=is_interpreted(_quant_act_kernel),
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return q, s


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    PER_BLOCK: tl.constexpr,  # block weights: scale every K step; else in the epilogue
    SCALE_K: tl.constexpr,  # block weights: columns per scale along K (block_k)
    SCALE_N: tl.constexpr,  # block weights: rows of W per scale (block_n)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // SCALE_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if PER_BLOCK:
            kb = k0 // SCALE_K
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not PER_BLOCK:
        a_s = tl.load(as_ptrs, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(m: int, n: int, interpreted: bool) -> dict:
    if interpreted:  # the interpreter pays per program: few, big tiles
        block_m = min(64, max(16, next_pow2(m)))
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4)
    block_k = 128
    if m <= 64:
        # From an H200 sweep at 8 and 64 rows (Llama-3-8B projections, block and channel
        # FP8, docs/performance.md): narrow N tiles give a small weight enough programs
        # to fill the SMs, and five stages keep its loads in flight; wide weights
        # (gate_up) take 128-column tiles, the best at 64 rows (at 8 rows the sweep's
        # best was the old 64-column, 4-stage tile; the engine ran this one, unchecked).
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 128 if n >= 16384 else 64 if n > 4096 else 32
        stages = 4 if block_n == 128 else 5
        cfg = dict(
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages
        )
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3)
    return dict(cfg, GROUP_M=8)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    fmt: Fp8Format,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """xq [M, K] FP8 with x_scale [M, G] (G = ceil(K / fmt.act_group(K))), weight
    [N, K] in the same FP8 type with weight_scale as fmt says -> [M, N] in out_dtype.
    config: launch settings (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) instead of
    the defaults, for benchmarks."""
    check_device(_fp8_gemm_kernel, xq, weight)
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    interpreted = is_interpreted(_fp8_gemm_kernel)
    cfg = dict(config) if config is not None else _config(m, n, interpreted)
    per_block = fmt.granularity == "block"
    if per_block:
        # each K step must lie inside one scale block (power-of-two blocks only)
        if fmt.block_k & (fmt.block_k - 1) or fmt.block_k < 16:
            raise ValueError(
                f"the triton FP8 GEMM needs a power-of-two block_k >= 16, not {fmt.block_k}"
            )
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], fmt.block_k)
        bs_strides = (weight_scale.stride(0), weight_scale.stride(1))
        scale_n, scale_k = fmt.block_n, fmt.block_k
    else:
        # tensor scales are read as a row of N equal values (stride 0)
        bs_strides = (weight_scale.stride(0) if fmt.granularity == "channel" else 0, 0)
        scale_n, scale_k = 1, 1
    num_warps = cfg.pop("num_warps")
    num_stages = cfg.pop("num_stages", 2)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    pdl = use_pdl(xq)
    _fp8_gemm_kernel[grid](
        xq,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        xq.stride(0),
        weight.stride(0),
        out.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        *bs_strides,
        PER_BLOCK=per_block,
        SCALE_K=scale_k,
        SCALE_N=scale_n,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **cfg,
    )
    return out


def fp8_linear(
    x: torch.Tensor,
    layer,
    row_stages: int | None = None,
    row_fold: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """An Fp8Linear's forward: one row through the fused FP8 GEMV (fp8_gemv.py), more
    rows quantized as the format says, then the FP8 GEMM. row_stages, row_fold: the
    GEMV's K-loop depth and (block_k, k_fold, num_warps[, block_n]) (the tuner's picks), for
    one row."""

    fmt = layer.fp8_format
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    weight = layer.weight
    if fp8_gemv.supports(x2.shape[0], fmt, weight):  # a decode row: one fused launch
        out = fp8_gemv.fp8_gemv(
            x2, weight, layer.weight_scale, fmt, layer.bias, num_stages=row_stages,
            fold=row_fold,
        )  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])
    xq, xs = quantize_activation(x2, fmt.act_group(k), weight.dtype)
    if weight.stride(1) != 1:
        raise ValueError("the triton FP8 GEMM needs an FP8 weight with unit stride along K")
    out = fp8_gemm(xq, xs, weight, layer.weight_scale, fmt, layer.bias, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])
