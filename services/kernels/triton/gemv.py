"""GEMV for decode-sized batches: out = x @ weight.T (+ bias) for x of at most 8 rows.

Why: at batch 1 a projection is a pass over its weight, so only memory bandwidth
counts, and on the H200 cuBLAS streams Llama-3-8B's qkv (6144x4096) and o_proj
(4096x4096) weights at ~3.1 and ~2.6 TB/s, well below the ~4.2 TB/s the HBM gives.
Measured back to back in a CUDA graph (bf16, batch 1, cuBLAS -> this): qkv 3.3 -> 3.5,
o_proj 2.6 -> 3.3, gate_up 4.2 -> 4.25, down 3.7 -> 4.0 TB/s; at 8 rows it ties or
wins by up to 15% except gate_up (-2%).

Grid: (cdiv(N, BLOCK_N), SPLIT_K). Each program owns BLOCK_N output columns (rows of
W) and walks its share of K in [BLOCK_N, BLOCK_K] tiles, contiguous along K, keeping
fp32 partial sums; x's rows are re-read per tile from L2 (they are tiny). One row
accumulates elementwise FMAs in an fp32 [BLOCK_N, BLOCK_K] tile and reduces it once
after the loop; 2..8 rows are padded to the 16 rows of a tensor-core tile (tl.dot),
which measured faster than FMAs over a [rows, BLOCK_N, BLOCK_K] tile.

With SPLIT_K > 1 each split writes its fp32 partial to a workspace and a second small
kernel adds the splits (and the bias): no atomics, no zero-init, so the pair is safe
to capture in a CUDA graph (the workspace size depends on shapes only).

HAS_NORM (one row): x is built from h + residual and an RMSNorm's weight inside the
kernel, the norm's own launch folded in (norm_fold.py). GATED (split_k 1): a gate_up
weight, each program's rows half gate rows and half the matching up rows, storing
silu(gate) * up (gated_gemv.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import (
    check_device,
    device_sms,
    is_interpreted,
    next_pow2,
    pdl_sync,
    use_pdl,
)
from services.kernels.triton.activation import store_silu_mul
from services.kernels.triton.norm import fold_launch_args, normed_cols, row_rstd

GEMV_MAX_ROWS = 8
GEMV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One row's W tiles in flight by default: 1 (plain loads) until a deeper K loop is
# measured on a device (benchmarks/gemv_configs_bench.py --stages)
ROW_STAGES = 1
_DOT_MIN = 16  # tl.dot needs >= 16 along every dim: rows pad to 16, blocks round up


@dataclass(frozen=True)
class GemvConfig:
    """Launch settings. block_n, block_k: powers of two; for 2..8 rows (the tensor-core
    path) block_n is rounded up to 16. num_stages: W tiles in flight per program (one
    row: the K loop's cp.async depth, 1 = plain loads). k_fold (one row): adjacent
    columns of a tile summed in registers before they join the fp32 partial tile, which
    is k_fold times smaller, so a wider W tile fits the same registers."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    k_fold: int = 1

    def __post_init__(self):
        for name, low in (("block_n", 1), ("block_k", 16)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {low}, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        for name in ("num_stages", "split_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_k_fold(self.k_fold, self.block_k)


def check_k_fold(k_fold, block_k: int) -> None:
    """A fold (GemvConfig, Fp8GemvConfig, the MoE GEMV config) splits a tile's columns
    into equal runs: a power of two no wider than the tile."""
    if not isinstance(k_fold, int) or k_fold < 1 or k_fold & (k_fold - 1) or k_fold > block_k:
        raise ValueError(f"k_fold must be a power of two <= block_k ({block_k}), got {k_fold!r}")


def with_row_fold(config, row_fold):
    """config (GemvConfig or Fp8GemvConfig) with a one-row tile in place of its own:
    row_fold = (block_k, k_fold, num_warps[, block_n]), as the kernel tuner stores it."""
    if len(row_fold) not in (3, 4):
        raise ValueError(
            f"row_fold is (block_k, k_fold, num_warps[, block_n]), got {tuple(row_fold)!r}"
        )
    block_n = row_fold[3] if len(row_fold) == 4 else config.block_n
    return replace(
        config, block_n=block_n, block_k=row_fold[0], k_fold=row_fold[1], num_warps=row_fold[2]
    )


def default_config(n: int, k: int, num_sms: int, m: int = 1) -> GemvConfig:
    """From an H200 sweep (bf16, Llama-3-8B projections, back-to-back in a CUDA graph).
    The bytes in flight per SM are ~N * BLOCK_K / num_sms, so narrower weights take
    deeper K tiles; wide ones take smaller tiles and more programs to balance the
    tail."""
    block_k_max = max(16, next_pow2(k))
    if m == 1:  # FMA path: ROW_STAGES W tiles in flight per program
        if n >= 32 * num_sms:
            cfg = GemvConfig(4, min(512, block_k_max), num_warps=2, num_stages=ROW_STAGES)
        else:
            cfg = GemvConfig(8, min(1024, block_k_max), num_warps=4, num_stages=ROW_STAGES)
        block_n = cfg.block_n
        while block_n > 1 and triton.cdiv(n, block_n) < 2 * num_sms:
            block_n //= 2
        return replace(cfg, block_n=block_n)
    # tensor-core path: 16K-element W tiles, 4 stages deep (one or two CTAs per SM)
    if n >= 128 * num_sms:
        block_n, block_k = 128, 128
    elif n >= 32 * num_sms:
        block_n, block_k = 64, 256
    else:
        block_n, block_k = 32, 512
    if 2 * triton.cdiv(n, block_n) < num_sms:  # small weights: at least fill the SMs
        block_n = _DOT_MIN
    return GemvConfig(block_n=block_n, block_k=min(block_k, block_k_max), num_stages=4)


def _interpreter_config(n: int, k: int) -> GemvConfig:
    # the interpreter pays per program and per loop step: one big tile
    return GemvConfig(block_n=min(256, next_pow2(n)), block_k=min(512, max(16, next_pow2(k))))


@triton.jit
def _load_tile(ptrs, k, offs_k, k_end, EVEN_K: tl.constexpr):
    if EVEN_K:  # no masks: the loads stay 16-byte vectors
        return tl.load(ptrs)
    return tl.load(ptrs, mask=((k + offs_k) < k_end)[None, :], other=0.0)


@triton.jit
def _load_tiles(w_ptrs, x_ptrs, k, offs_k, k_end, EVEN_K: tl.constexpr):
    w = _load_tile(w_ptrs, k, offs_k, k_end, EVEN_K)
    return w, _load_tile(x_ptrs, k, offs_k, k_end, EVEN_K)


@triton.jit
def _x_tile(x_ptrs, k, offs_k, k_end, EVEN_K: tl.constexpr, h_ptr, res_ptr, nw_ptr,
            res_out_ptr, x_out_ptr, rstd, HAS_NORM: tl.constexpr, STORE):  # fmt: skip
    # one row's x tile [1, BLOCK_K]: loaded, or normalised from h + res (norm folded in)
    if HAS_NORM:
        cols = (k + offs_k)[None, :]
        return normed_cols(h_ptr, res_ptr, nw_ptr, res_out_ptr, x_out_ptr, cols, cols < k_end,
                           rstd, STORE)  # fmt: skip
    return _load_tile(x_ptrs, k, offs_k, k_end, EVEN_K).to(tl.float32)


@triton.jit
def folded(prod, FOLD: tl.constexpr):
    """prod [rows, cols] with each run of FOLD adjacent columns summed (in registers:
    a thread's loads hold adjacent columns)."""
    if FOLD == 1:
        return prod
    ROWS: tl.constexpr = prod.shape[0]
    COLS: tl.constexpr = prod.shape[1]
    return tl.sum(tl.reshape(prod, [ROWS, COLS // FOLD, FOLD]), axis=2)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,  # [M, N] in x's dtype, or the fp32 [SPLIT_K, M, N] workspace
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,  # 1 (one row: FMAs) or 16 (tensor cores)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16 (uint16 bits)
    NUM_STAGES: tl.constexpr,  # one row: W tiles in flight (cp.async into shared memory)
    USE_PDL: tl.constexpr,
    FOLD: tl.constexpr,  # one row: GemvConfig.k_fold
    res_ptr,  # HAS_NORM: x is h, and the row multiplied is rms_norm(h + res) * nw
    nw_ptr,
    res_out_ptr,  # HAS_NORM: h + res and the normalised row, stored by the first programs
    x_out_ptr,
    eps,
    HAS_NORM: tl.constexpr,  # one row only (norm_fold.add_rms_norm_gemv)
    gate_rows,  # GATED: the gate's rows (N = 2 * gate_rows; out is [M, gate_rows])
    GATED: tl.constexpr,  # SPLIT_K 1 only (gated_gemv.py)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows re-read valid ones (wrapped) instead of masking, so the loads
    # stay unpredicated; their results are never stored.
    if GATED:  # BLOCK_N / 2 gate rows, then the same rows of the up half
        HALF: tl.constexpr = BLOCK_N // 2
        offs_g = pid_n * HALF + tl.arange(0, BLOCK_N) % HALF
        w_rows = offs_g % gate_rows + tl.where(tl.arange(0, BLOCK_N) < HALF, 0, gate_rows)
        w_rows = w_rows.to(tl.int64)
    else:
        w_rows = (offs_n % N).to(tl.int64)
    x_rows = offs_m % M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk

    if BLOCK_M == 1:
        # One row: elementwise FMAs into an fp32 [BLOCK_N, BLOCK_K] tile and a single
        # reduction after the loop (5-25% faster than a padded tensor-core tile).
        part = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
        k_loop = k_start
        rstd = 1.0
        if USE_PDL:  # the first weight tile loads while the previous kernel drains
            w = _load_tile(w_ptrs, k_start, offs_k, k_end, EVEN_K)
            pdl_sync(USE_PDL)
            if HAS_NORM:
                rstd = row_rstd(x_ptr, res_ptr, K, eps, BLOCK_K)
            x = _x_tile(x_ptrs, k_start, offs_k, k_end, EVEN_K, x_ptr, res_ptr, nw_ptr,
                        res_out_ptr, x_out_ptr, rstd, HAS_NORM, pid_n == 0)  # fmt: skip
            part += folded(w.to(tl.float32) * x.to(tl.float32), FOLD)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K * stride_xk
            k_loop += BLOCK_K
        elif HAS_NORM:
            rstd = row_rstd(x_ptr, res_ptr, K, eps, BLOCK_K)
        for k in tl.range(k_loop, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = _load_tile(w_ptrs, k, offs_k, k_end, EVEN_K)
            x = _x_tile(x_ptrs, k, offs_k, k_end, EVEN_K, x_ptr, res_ptr, nw_ptr,
                        res_out_ptr, x_out_ptr, rstd, HAS_NORM, pid_n == 0)  # fmt: skip
            part += folded(w.to(tl.float32) * x.to(tl.float32), FOLD)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K * stride_xk
        acc = tl.sum(part, axis=1)[None, :]
    else:
        pdl_sync(USE_PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            w, x = _load_tiles(w_ptrs, x_ptrs, k, offs_k, k_end, EVEN_K)
            if UPCAST_DOT:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K * stride_xk

    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    if GATED:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
        pair = tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2])  # [rows, gate | up, outputs]
        first = (tl.arange(0, 2) == 0)[None, :, None]
        gate = tl.sum(tl.where(first, pair, 0.0), axis=1)
        up = tl.sum(tl.where(first, 0.0, pair), axis=1)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ok = (offs_m < M)[:, None] & (cols < gate_rows)[None, :]
        store_silu_mul(out_ptr, offs_m[:, None] * gate_rows + cols[None, :], ok, gate, up)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + out_offs, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,  # [SPLIT_K, M, N] fp32
    bias_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but weight is {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs a row-major weight (stride 1 along K)")
    if x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"gemv supports fp32/fp16/bf16 x and weight of one dtype, got "
            f"{x.dtype} and {weight.dtype}"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    row_stages: int | None = None,
    row_fold: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """torch.nn.functional.linear(x, weight, bias) for x [M <= 8, K] (any strides) and a
    row-major weight [N, K]; fp32 accumulation, output [M, N] in x's dtype. row_stages:
    for one row, the K loop's depth in place of the config's (the kernel tuner's pick
    for this GPU); more rows take their tensor-core path's own. row_fold: (block_k,
    k_fold, num_warps[, block_n]) for one row in place of the config's, likewise."""
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    check_device(_gemv_kernel, x, weight, *(() if bias is None else (bias,)))
    config = launch_config(x, n, config, row_stages, row_fold)
    launch(x, weight, bias, out, config)
    return out


def launch_config(x, n: int, config=None, row_stages=None, row_fold=None) -> GemvConfig:
    """The config gemv launches for x [M, K] and an [n, K] weight: `config`, or the
    interpreter's or this GPU's default; row_stages and row_fold apply to one row."""
    m, k = x.shape
    if config is None:
        config = (
            _interpreter_config(n, k)
            if is_interpreted(_gemv_kernel)
            else default_config(n, k, device_sms(x), m)
        )
    if row_stages is not None and m == 1:
        config = replace(config, num_stages=row_stages)
    if row_fold is not None and m == 1:
        config = with_row_fold(config, row_fold)
    return config


def launch(x, weight, bias, out, cfg: GemvConfig, norm=None, gated=False) -> None:
    """The GEMV into out. norm (one row; norm_fold.py): (residual, norm_weight,
    residual_out, normed_out, eps), x then being the h of fused_add_rms_norm(h, residual).
    gated (split_k 1; gated_gemv.py): out [M, N / 2] takes silu(gate) * up."""
    m, k = x.shape
    n = weight.shape[0]
    block_k = cfg.block_k
    block_m, block_n = (1, cfg.block_n) if m == 1 else (_DOT_MIN, max(_DOT_MIN, cfg.block_n))
    # splits start on tile boundaries: when BLOCK_K divides K, no split needs masks
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # drop splits that would be empty
    if gated and (split_k != 1 or n % 2):
        raise ValueError(f"a gated GEMV takes split_k 1 and 2I rows; got {cfg}, {n}")
    if gated:
        block_n = max(2, block_n)  # a gate row and its up row at least
    upcast = is_interpreted(_gemv_kernel) and x.dtype == torch.bfloat16
    dst = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x)
    grid_n = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    _gemv_kernel[(grid_n, split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        dst,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        UPCAST_DOT=upcast,
        NUM_STAGES=cfg.num_stages,
        USE_PDL=pdl,
        FOLD=min(cfg.k_fold, block_k) if m == 1 else 1,
        **fold_launch_args(x, norm),
        gate_rows=n // 2,
        GATED=gated,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    if split_k > 1:
        block = min(1024, next_pow2(m * n))
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            dst,
            bias if bias is not None else dst,
            out,
            m,
            n,
            HAS_BIAS=bias is not None,
            SPLIT_K=split_k,
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
