"""FP8 GEMV for one decode row: out = dequant(quant(x)) @ dequant(W).T (+ bias) for x
[1, K] and an FP8 linear layer (services/kernels/fp8.py says what the formats mean).

Why: at batch 1 a projection is a pass over its weight, and the tiled FP8 GEMM
(fp8_gemm.py) streams it at about half the HBM bandwidth: its 16-row tensor-core tiles
waste the MMA and give too few programs to fill the SMs. Here each program owns
BLOCK_N rows of W and walks K in [BLOCK_N, BLOCK_K] tiles with elementwise FMAs into an
fp32 tile, reduced once after the loop (the bf16 GEMV's one-row path, gemv.py), and
the activation quantization is fused in, so the layer is one launch instead of two:

- block weights: each K tile covers whole 128-column activation groups (BLOCK_K is a
  multiple of block_k); a program computes the groups' amax from x (16 KB at most,
  read from L2), quantizes and dequantizes x exactly as the reference does (a correctly
  rounded quotient from the group's reciprocal, fp8_round.quantize_e4m3_by; an
  RNE cast to e4m3), and folds in the weight's block scale for the tile's groups. All
  BLOCK_N rows share one scale row because BLOCK_N divides block_n.
- channel / tensor weights: one activation scale for the whole row, from an amax pass
  over x first; the row's and the weight's scales multiply the sum at the end.

HAS_NORM: the row is rms_norm(h + residual) * weight, built in the kernel (the norm's
launch folded in, norm_fold.py; add_rms_norm_fp8_gemv). GATED: a gate_up weight, each
program taking BLOCK_N / 2 gate rows and the matching up rows as two tiles (each with
its own block scales) and storing silu(gate) * up (gated_gemv.py).

One plain launch, shape-only sizes, no atomics: safe to capture in a CUDA graph. Runs
under TRITON_INTERPRET=1 on a CPU (e4m3fn only, like fp8_gemm.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from services.kernels.fp8 import MIN_AMAX, Fp8Format, fp8_max, is_pow2
from services.kernels.triton._launch import (
    check_device,
    device_sms,
    is_interpreted,
    next_pow2,
    pdl_sync,
    use_pdl,
)
from services.kernels.triton.activation import store_silu_mul
from services.kernels.triton.fp8_round import activation_scale, quantize_e4m3_by, reciprocal_rn
from services.kernels.triton.gemv import check_k_fold, folded, with_row_fold
from services.kernels.triton.norm import (
    check_fold_inputs,
    fold_launch_args,
    normed_cols,
    row_rstd,
)

# W tiles in flight by default: 1 (plain loads); 3 was slower on an H100 (Llama-3-8B FP8
# batch 1 3.77 -> 3.90 ms, docs/performance.md), and the kernel tuner times both per GPU
DEFAULT_STAGES = 1
_GRANULARITY_CODE = {"block": 0, "channel": 1, "tensor": 2}
# programs an sm_90 SM holds of the default tile, by rows (127, 168 registers: test_compile_sm90)
PROGRAMS_PER_SM = {8: 4, 16: 3}


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Launch settings: block_n rows of W per program, block_k columns per tile (both
    powers of two)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1  # W tiles in flight per program (cp.async into shared memory)
    # adjacent columns of a tile summed in registers before they join the fp32 partial
    # tile: a k_fold-times smaller partial, so a wider W tile fits the same registers
    k_fold: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or not is_pow2(v):
                raise ValueError(f"{name} must be a power of two, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")
        check_k_fold(self.k_fold, self.block_k)


def supports(x_rows: int, fmt: Fp8Format, weight: torch.Tensor) -> bool:
    """Whether the GEMV takes this call: one row, a row-major weight and, for block
    weights, power-of-two blocks (a tile must cover whole groups and one scale row)."""
    if x_rows != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        return False
    if fmt.granularity == "block":
        return is_pow2(fmt.block_n) and is_pow2(fmt.block_k) and fmt.block_k >= 16
    return True


def default_config(n: int, k: int, fmt: Fp8Format, num_sms: int) -> Fp8GemvConfig:
    """8 x 2048 tiles, 4 warps, 16 adjacent columns summed first (k_fold; without it the
    tile needs 247 registers): H100 Llama-3-8B FP8 decode 3.77 -> 3.62 ms against 8 x 1024.
    Narrower below two programs per SM; 16 rows where only they fit one wave: a partial
    last wave is a latency-bound tail (H100, Llama-3-8B's qkv: 11.0 -> 10.1 us)."""
    block_n, block_k = 8, 2048
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * num_sms:
        block_n //= 2
    slots = {rows: per_sm * num_sms for rows, per_sm in PROGRAMS_PER_SM.items()}
    if block_n == 8 and triton.cdiv(n, 8) > slots[8] and triton.cdiv(n, 16) <= slots[16]:
        block_n = 16
    return _fit(Fp8GemvConfig(block_n, block_k, 4, DEFAULT_STAGES, 16), k, fmt)


def _fit(cfg: Fp8GemvConfig, k: int, fmt: Fp8Format) -> Fp8GemvConfig:
    """Clamp the tile to the layer: no wider than K needs, and for block weights a
    multiple of block_k along K and a divisor of block_n along N."""
    block_k = min(cfg.block_k, max(16, next_pow2(k)))
    block_n = cfg.block_n
    if fmt.granularity == "block":
        block_k = max(block_k, fmt.block_k)
        block_n = min(block_n, fmt.block_n)
    return Fp8GemvConfig(block_n, block_k, cfg.num_warps, cfg.num_stages, min(cfg.k_fold, block_k))


@triton.jit
def _quantized(x, scale, inv_scale, FP8_MAX_: tl.constexpr, ROUND_IN_FP32: tl.constexpr, FP8_TY):
    """x / scale rounded onto the e4m3 grid, as fp32 (the reference's quantize step;
    inv_scale = 1 / scale, correctly rounded, makes it cheap: quantize_e4m3_by)."""
    q = quantize_e4m3_by(x, scale, inv_scale, FP8_MAX_, ROUND_IN_FP32)
    return q.to(FP8_TY).to(tl.float32)


@triton.jit
def _load_w(w_ptrs, k, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=((k + offs_k) < K)[None, :], other=0.0)


@triton.jit
def _x_at(x_ptr, cols, K, EVEN_K: tl.constexpr, norm, HAS_NORM: tl.constexpr):
    """x at cols as fp32: loaded, or with the norm folded in (norm = (res_ptr, nw_ptr,
    res_out_ptr, x_out_ptr, rstd, store)) normalised from h + res."""
    if HAS_NORM:
        return normed_cols(x_ptr, norm[0], norm[1], norm[2], norm[3], cols, cols < K, norm[4],
                           norm[5])  # fmt: skip
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _fp8_tile(
    part, w, part_u, w_u, x_ptr, ws_row, ws_row_u, stride_wsk, x_scale, inv_x_scale, k,
    offs_k, K, GRANULARITY: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    FP8_MAX_: tl.constexpr, MIN_AMAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8_TY, FOLD: tl.constexpr, norm, HAS_NORM: tl.constexpr,
    GATED: tl.constexpr, xs_ptr, PREQUANT: tl.constexpr,
):  # fmt: skip
    """(part, part_u) + one K tile's products: x quantized and dequantized, times W's
    tile (GATED: and times the up rows' tile w_u, with their own block scales).
    PREQUANT: x already quantized, its groups' (or row's) scales at xs_ptr."""
    if GRANULARITY == 0:
        # per 128-column group: the activation scale, and the weight's block scale; x
        # is read as [groups, GROUP] so the scales need no reshapes, one at the end
        G: tl.constexpr = BLOCK_K // GROUP
        offs_g = tl.arange(0, G)
        cols = k + offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x2 = _x_at(x_ptr, cols, K, EVEN_K, norm, HAS_NORM)
        g_idx = k // GROUP + offs_g
        g_ok = g_idx * GROUP < K
        ws = tl.load(ws_row + g_idx * stride_wsk, mask=g_ok, other=0.0)
        if PREQUANT:  # x2 holds the e4m3 values already (norm_quant.py)
            s = tl.load(xs_ptr + g_idx, mask=g_ok, other=1.0)
            q = x2
        else:
            s = activation_scale(tl.max(tl.abs(x2), axis=1), MIN_AMAX, FP8_MAX_)
            q = _quantized(x2, s[:, None], reciprocal_rn(s)[:, None], FP8_MAX_, ROUND_IN_FP32,
                           FP8_TY)  # fmt: skip
        xd = tl.reshape(q * (s * ws)[:, None], [BLOCK_K])
        if GATED:
            ws_u = tl.load(ws_row_u + g_idx * stride_wsk, mask=g_ok, other=0.0)
            xd_u = tl.reshape(q * (s * ws_u)[:, None], [BLOCK_K])
            part_u += folded(w_u.to(tl.float32) * xd_u[None, :], FOLD)
    else:
        x = _x_at(x_ptr, k + offs_k, K, EVEN_K, norm, HAS_NORM)
        xd = x if PREQUANT else _quantized(x, x_scale, inv_x_scale, FP8_MAX_, ROUND_IN_FP32, FP8_TY)
        if GATED:
            part_u += folded(w_u.to(tl.float32) * xd[None, :], FOLD)
    return part + folded(w.to(tl.float32) * xd[None, :], FOLD), part_u


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K] (one row, unit stride)
    w_ptr,  # [N, K] FP8, unit stride along K
    ws_ptr,  # weight scales: [N/bn, K/bk], [N] or a scalar
    bias_ptr,
    out_ptr,  # [N] in x's dtype
    N,
    K,
    stride_wn,
    stride_wsn,
    stride_wsk,
    GRANULARITY: tl.constexpr,  # 0 block, 1 channel, 2 tensor
    GROUP: tl.constexpr,  # block weights: columns per activation scale (block_k)
    SCALE_N: tl.constexpr,  # block weights: rows of W per scale (block_n)
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    FOLD: tl.constexpr,  # Fp8GemvConfig.k_fold
    res_ptr,  # HAS_NORM: x is h, and the row quantized is rms_norm(h + res) * nw
    nw_ptr,
    res_out_ptr,  # HAS_NORM: h + res and the normalised row, stored by program 0
    x_out_ptr,
    eps,
    HAS_NORM: tl.constexpr,
    gate_rows,  # GATED: the gate's rows (N = 2 * gate_rows, a multiple of ROWS)
    GATED: tl.constexpr,
    xs_ptr,  # PREQUANT: x holds the quantized row, these its groups' (row's) scales
    PREQUANT: tl.constexpr,
):
    fp8_ty = w_ptr.dtype.element_ty
    pid = tl.program_id(0)
    ROWS: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N  # rows per tile
    offs_n = pid * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past N re-read valid ones (wrapped) so the loads stay unmasked; never stored
    w_rows = (offs_n % N).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
    ws_row = ws_ptr + ((pid * ROWS) // SCALE_N) * stride_wsn  # block weights' scale row
    # GATED: the up rows (pointers the same as the gate's otherwise, never read)
    up = 0
    if GATED:
        up = gate_rows
    w_ptrs_u = w_ptrs + up * stride_wn
    ws_row_u = ws_ptr + ((up + pid * ROWS) // SCALE_N) * stride_wsn
    if USE_PDL:  # the first weight tile loads while the previous kernel drains
        w = _load_w(w_ptrs, 0, offs_k, K, EVEN_K)
        w_u = w
        if GATED:
            w_u = _load_w(w_ptrs_u, 0, offs_k, K, EVEN_K)
        pdl_sync(USE_PDL)
    rstd = 1.0
    if HAS_NORM:
        rstd = row_rstd(x_ptr, res_ptr, K, eps, BLOCK_K)
    norm = (res_ptr, nw_ptr, res_out_ptr, x_out_ptr, rstd, pid == 0)
    x_scale = 1.0
    inv_x_scale = 1.0
    if GRANULARITY != 0 and PREQUANT:
        x_scale = tl.load(xs_ptr)
    elif GRANULARITY != 0:  # one activation scale per row: amax over all of K first
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        no_store = (res_ptr, nw_ptr, res_out_ptr, x_out_ptr, rstd, False)
        for k in range(0, K, BLOCK_K):
            x = _x_at(x_ptr, k + offs_k, K, False, no_store, HAS_NORM)
            amax = tl.maximum(amax, tl.abs(x))
        x_scale = activation_scale(tl.max(amax, axis=0), MIN_AMAX, FP8_MAX_)
        inv_x_scale = reciprocal_rn(x_scale)

    # (A 3-D [BLOCK_N, G, GROUP] tile without the reshapes measured 3-9% slower on the
    # H200, and prefetching the next W tile into registers spilled.)
    part = tl.zeros([ROWS, BLOCK_K // FOLD], dtype=tl.float32)
    part_u = tl.zeros([ROWS if GATED else 1, BLOCK_K // FOLD], dtype=tl.float32)
    k_loop = 0
    if USE_PDL:
        part, part_u = _fp8_tile(
            part, w, part_u, w_u, x_ptr, ws_row, ws_row_u, stride_wsk, x_scale, inv_x_scale,
            0, offs_k, K, GRANULARITY, GROUP, EVEN_K, FP8_MAX_, MIN_AMAX, ROUND_IN_FP32,
            BLOCK_K, fp8_ty, FOLD, norm, HAS_NORM, GATED, xs_ptr, PREQUANT,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        w_ptrs_u += BLOCK_K
        k_loop = BLOCK_K
    for k in tl.range(k_loop, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_w(w_ptrs, k, offs_k, K, EVEN_K)
        w_u = w
        if GATED:
            w_u = _load_w(w_ptrs_u, k, offs_k, K, EVEN_K)
        part, part_u = _fp8_tile(
            part, w, part_u, w_u, x_ptr, ws_row, ws_row_u, stride_wsk, x_scale, inv_x_scale,
            k, offs_k, K, GRANULARITY, GROUP, EVEN_K, FP8_MAX_, MIN_AMAX, ROUND_IN_FP32,
            BLOCK_K, fp8_ty, FOLD, norm, HAS_NORM, GATED, xs_ptr, PREQUANT,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        w_ptrs_u += BLOCK_K
    acc = _scaled_sum(part, ws_ptr, offs_n, N, stride_wsn, x_scale, bias_ptr, GRANULARITY, HAS_BIAS)
    if GATED:
        up_rows = gate_rows + offs_n
        acc_u = _scaled_sum(part_u, ws_ptr, up_rows, N, stride_wsn, x_scale, bias_ptr,
                            GRANULARITY, HAS_BIAS)  # fmt: skip
        store_silu_mul(out_ptr, offs_n, offs_n < gate_rows, acc, acc_u)
    else:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _scaled_sum(part, ws_ptr, rows, N, stride_wsn, x_scale, bias_ptr,
                GRANULARITY: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The rows' sums in fp32 with a channel or tensor weight's scales and the bias."""
    acc = tl.sum(part, axis=1)
    n_ok = rows < N
    if GRANULARITY == 1:
        acc *= x_scale * tl.load(ws_ptr + rows * stride_wsn, mask=n_ok, other=0.0)
    elif GRANULARITY == 2:
        acc *= x_scale * tl.load(ws_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)
    return acc


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    fmt: Fp8Format,
    bias: torch.Tensor | None,
    *,
    config: Fp8GemvConfig | None = None,
    num_stages: int | None = None,
    fold: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x [1, K] -> [1, N] in x's dtype: fp8.fp8_linear_reference's math in one launch.
    num_stages: the K loop's depth in place of the config's (the kernel tuner's pick);
    fold: (block_k, k_fold, num_warps[, block_n]) in place of the config's, likewise."""
    _check(x, fmt, weight)
    return run(x.contiguous(), weight, weight_scale, fmt, bias, config, num_stages, fold)


def add_rms_norm_fp8_gemv(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    fmt: Fp8Format,
    bias: torch.Tensor | None,
    *,
    config: Fp8GemvConfig | None = None,
    num_stages: int | None = None,
    fold: tuple[int, ...] | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8_gemv(x, ...), x, h + residual) for x = fused_add_rms_norm(h, residual,
    norm_weight, eps)[0], in one launch (norm_fold.add_rms_norm_gemv's fold: each program
    finds the row's rms first, then quantizes the normalised row as fp8_gemv would).
    gated: a gate_up weight, silu(gate) * up in place of its output (gated_gemv.py)."""
    check_fold_inputs("add_rms_norm_fp8_gemv", h, residual, norm_weight)
    _check(h, fmt, weight)
    h, residual, norm_weight = h.contiguous(), residual.contiguous(), norm_weight.contiguous()
    normed, res_out = torch.empty_like(h), torch.empty_like(h)
    norm = (residual, norm_weight, res_out, normed, eps)
    out = run(h, weight, weight_scale, fmt, bias, config, num_stages, fold, norm, gated)
    return out, normed, res_out


def _check(x, fmt, weight) -> None:
    if not supports(x.shape[0], fmt, weight):  # before the device: a shape error reads first
        raise ValueError(
            f"fp8_gemv takes one row and a row-major weight with power-of-two blocks; got "
            f"x {tuple(x.shape)}, weight strides {weight.stride()}, {fmt}"
        )
    check_device(_fp8_gemv_kernel, x, weight)


def launch_config(x, n: int, fmt: Fp8Format, config=None, num_stages=None, fold=None):
    """The config fp8_gemv launches for x [1, K] and an [n, K] weight of format fmt:
    `config`, or the interpreter's or this GPU's default, with num_stages and fold."""
    k = x.shape[1]
    if config is None:
        # the interpreter pays per program and per loop step: few, big tiles
        config = (
            Fp8GemvConfig(min(64, next_pow2(n)), 512)
            if is_interpreted(_fp8_gemv_kernel)
            else default_config(n, k, fmt, device_sms(x))
        )
    if num_stages is not None:
        config = replace(config, num_stages=num_stages)
    if fold is not None:
        config = with_row_fold(config, fold)
    return _fit(config, k, fmt)


def gated_rows_fit(n: int, cfg: Fp8GemvConfig) -> bool:
    """Whether a gate_up weight of n rows can run gated with cfg: each program's tile
    of gate rows (and of up rows) within one weight scale row, none past the gate's."""
    return n % 2 == 0 and (n // 2) % max(1, cfg.block_n // 2) == 0


def run(x, weight, weight_scale, fmt, bias, config, num_stages, fold, norm=None, gated=False,
        x_scales=None):  # fmt: skip
    """The GEMV's launch for checked inputs (fp8_gemv's; norm: add_rms_norm_fp8_gemv's;
    gated: out [1, N / 2] takes silu(gate) * up, gated_gemv.py; x_scales: x is already
    quantized, these its activation groups' scales, norm_quant.py)."""
    k = x.shape[1]
    n = weight.shape[0]
    out = torch.empty((1, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    interpreted = is_interpreted(_fp8_gemv_kernel)
    cfg = launch_config(x, n, fmt, config, num_stages, fold)
    if gated:
        cfg = replace(cfg, block_n=max(2, cfg.block_n))  # a gate row and its up row at least
        if not gated_rows_fit(n, cfg):
            raise ValueError(f"a gated FP8 GEMV cannot take {n} rows in tiles of {cfg.block_n}")
    if fmt.granularity == "block":
        ws_strides = (weight_scale.stride(0), weight_scale.stride(1))
        group, scale_n = fmt.block_k, fmt.block_n
    else:
        ws_strides = (weight_scale.stride(0) if fmt.granularity == "channel" else 0, 0)
        group, scale_n = 1, 1
    pdl = use_pdl(x)
    grid = triton.cdiv(n // 2, cfg.block_n // 2) if gated else triton.cdiv(n, cfg.block_n)
    _fp8_gemv_kernel[(grid,)](
        x,
        weight,
        weight_scale,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        n,
        k,
        weight.stride(0),
        *ws_strides,
        GRANULARITY=_GRANULARITY_CODE[fmt.granularity],
        GROUP=group,
        SCALE_N=scale_n,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        FP8_MAX_=fp8_max(weight.dtype),
        MIN_AMAX=MIN_AMAX,
        ROUND_IN_FP32=interpreted,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages,
        USE_PDL=pdl,
        FOLD=cfg.k_fold,
        **fold_launch_args(x, norm),
        gate_rows=n // 2,
        GATED=gated,
        xs_ptr=x if x_scales is None else x_scales,  # never read without PREQUANT
        PREQUANT=x_scales is not None,
        num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )
    return out
