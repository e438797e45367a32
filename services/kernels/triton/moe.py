"""Fused mixture-of-experts MLP (Qwen3-MoE, Mixtral): routing, token-expert alignment
and two grouped GEMMs, with no host synchronisation (decode steps run in CUDA graphs).

    out[t] = sum over its top_k experts e of w_te * (silu(x_t Wg_e^T) * (x_t Wu_e^T)) W2_e^T

Steps (M = T * top_k (token, expert) pairs, pair p = t * top_k + slot):

1. Routing and alignment (`moe_align.route_and_align`, Triton, no host syncs): softmax in fp32,
   the top_k largest, optional renormalize, as the torch backend's select_experts;
   the weights cast to x's dtype. The pairs are grouped by expert (token order inside
   an expert) and each expert's group is padded to a multiple of BLOCK_M, giving
   `sorted_ids` (pair indices, padding = M), `tile_expert` (the expert of each
   BLOCK_M tile) and `num_valid_tiles` (a 1-element device tensor). Every shape
   depends on (T, top_k, E, BLOCK_M) only: at most min(E, M) experts are non-empty, so
   M + min(E, M) * (BLOCK_M - 1) rows, rounded up to BLOCK_M, always suffice. One
   launch for decode batches, three for larger ones (see below).
3. GEMM 1 (`GATED`): per tile, x rows pair // top_k (gathered) times its expert's gate
   and up rows of w13, two fp32 accumulators; the epilogue writes
   silu(gate) * up -> act [M, I] in x's dtype (computed in fp32, rounded once), so the
   [M, 2I] gate/up intermediate never reaches memory.
4. GEMM 2: act rows times w2[e]^T, scaled by the pair's routing weight in the epilogue
   -> [M, H] in x's dtype, indexed by pair; then [T, top_k, H].sum(1) (fp32
   accumulation inside torch's reduction; no atomics, deterministic).

FP8 experts (`fp8=Fp8Experts`, FP8 w13 / w2): each GEMM's input is quantized first,
per token (GEMM 1) or pair (GEMM 2), per block_k group for block weights and over the
whole row for channel ones (fp8_gemm's quantizer, one launch each). Block weights:
every K step's FP8 dot is scaled by the row's activation scale and the weight block's
scale before it is added (the block FP8 GEMM's scheme; BLOCK_K is cut to divide
block_k). Channel weights: the dots sum unscaled and the epilogue multiplies by the
row's and the column's scales. The GEMV path takes no FP8 weights.

Both GEMMs launch the static maximum grid (tiles x column blocks, GROUP_M-swizzled);
programs whose tile is past `num_valid_tiles` return at once, and padding rows are
masked on store. Launch settings come from a config dict (BLOCK_M, BLOCK_N, BLOCK_K,
GROUP_M, num_warps, num_stages); `moe_config.default_config` picks one from the shapes,
and `moe_config.default_launch` takes the GEMV path (moe_gemv.py) for a single token.

Measured on an H200 (bf16, CUDA-graph replays, default configs): Qwen3-30B-A3B experts
(E=128, top-8, H=2048, I=768) T=1 47 us (routing + alignment 9 us), T=64 308 us
(~3.9 TB/s of expert weights), T=4096 940 us (~330 TFLOP/s); Mixtral-8x7B experts
(E=8, top-2, H=4096, I=14336) T=1 208 us (~3.4 TB/s), T=16 662 us (~4.3 TB/s),
T=4096 5.9 ms (~490 TFLOP/s)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.fp8 import FP8_DTYPES, Fp8Experts, expert_scale_shapes, experts_fit_fp8
from services.kernels.triton._launch import check_device, is_interpreted, pdl_sync, use_pdl
from services.kernels.triton.fp8_gemm import quantize_activation
from services.kernels.triton.moe_align import route_and_align
from services.kernels.triton.moe_config import _check_config, default_launch
from services.kernels.triton.moe_gemv import fused_moe_gemv

MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # GEMM 1: x [T, K]; GEMM 2: act [M, K]
    b_ptr,  # [E, N or 2N, K]: w13 (gate rows then up rows) or w2
    c_ptr,  # [M, N]
    as_ptr,  # FP8: a's scales [rows of a, K / SCALE_K]
    bs_ptr,  # FP8: b's block scales [E, rows of b / SCALE_N, K / SCALE_K]
    weight_ptr,  # [M] routing weights (MUL_WEIGHT)
    sorted_ids_ptr,
    tile_expert_ptr,
    num_valid_tiles_ptr,
    N,
    K,
    num_pairs,
    num_tiles,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bse,
    stride_bsn,
    stride_bsk,
    A_ROW_DIV: tl.constexpr,  # a row = pair // A_ROW_DIV (top_k for GEMM 1, else 1)
    GATED: tl.constexpr,  # B holds 2N rows: silu(gate) * up in the epilogue
    MUL_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16
    FP8: tl.constexpr,  # a and b FP8, scaled by a's (per row) and b's scales
    PER_BLOCK: tl.constexpr,  # FP8 block weights: every K step's dot; else the epilogue
    SCALE_N: tl.constexpr,  # FP8: rows of b per scale (block_n; 1 for channel scales)
    SCALE_K: tl.constexpr,  # FP8 block: columns per scale (block_k; BLOCK_K divides it)
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # GROUP_M-swizzled order: consecutive programs share B column blocks
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m >= tl.load(num_valid_tiles_ptr):
        return

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_r)
    row_ok = pair < num_pairs
    # padding rows re-read row 0 (their results are never stored): unmasked A loads
    a_rows = tl.where(row_ok, pair // A_ROW_DIV, 0).to(tl.int64)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = (offs_n % N).to(tl.int64)  # wrapped, not masked; never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + b_rows[None, :] * stride_bn + offs_k[:, None] * stride_bk
    up_off = N * stride_bn
    if FP8:
        as_ptrs = as_ptr + a_rows * stride_asm
        bs_ptrs = bs_ptr + expert * stride_bse + (b_rows // SCALE_N) * stride_bsn
        up_scale_off = (N // SCALE_N) * stride_bsn  # N is a multiple of SCALE_N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if GATED:
                b_up = tl.load(b_ptrs + up_off)
        else:
            k_ok = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None], other=0.0)
        if PER_BLOCK:
            kb = k // SCALE_K
            a_s = tl.load(as_ptrs + kb * stride_ask)[:, None]
            acc += tl.dot(a, b) * (a_s * tl.load(bs_ptrs + kb * stride_bsk)[None, :])
            if GATED:
                b_s_up = tl.load(bs_ptrs + up_scale_off + kb * stride_bsk)[None, :]
                acc_up += tl.dot(a, b_up) * (a_s * b_s_up)
        else:
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if GATED:
                    b_up = b_up.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if FP8 and not PER_BLOCK:  # channel scales: the row's and the column's, once
        a_s = tl.load(as_ptrs)[:, None]
        acc = acc * (a_s * tl.load(bs_ptrs)[None, :])
        if GATED:
            acc_up = acc_up * (a_s * tl.load(bs_ptrs + up_scale_off)[None, :])
    dtype = c_ptr.dtype.element_ty
    if GATED:  # silu(gate) * up in fp32: the product is the only rounding
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(dtype), mask=row_ok[:, None] & (offs_n < N)[None, :])


def _moe_gemm(a, b, c, weights, align, top_k_div, gated, cfg, precision, upcast, fp8=None):
    """fp8: None, or (a's scales [rows, K / bk] or [rows, 1], b's scales as
    Fp8Experts holds them, Fp8Format)."""
    sorted_ids, tile_expert, num_valid = align
    n = c.shape[1]
    k = a.shape[1]
    tiles = tile_expert.shape[0]
    grid = (tiles * triton.cdiv(n, cfg["BLOCK_N"]),)
    a_scale, b_scale, fmt = fp8 if fp8 is not None else (c, c.view(1, *c.shape), None)
    per_block = fmt is not None and fmt.granularity == "block"
    if fmt is not None and not per_block:
        b_scale = b_scale.unsqueeze(-1)  # [E, rows, 1]: the block layout with 1-row blocks
    block_k = min(cfg["BLOCK_K"], fmt.block_k) if per_block else cfg["BLOCK_K"]
    pdl = use_pdl(a)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        a_scale,
        b_scale,
        weights if weights is not None else c,
        sorted_ids,
        tile_expert,
        num_valid,
        n,
        k,
        c.shape[0],
        tiles,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        a_scale.stride(0),
        a_scale.stride(1),
        *b_scale.stride(),
        A_ROW_DIV=top_k_div,
        GATED=gated,
        MUL_WEIGHT=weights is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"],
        PRECISION=precision,
        UPCAST_DOT=upcast,
        FP8=fmt is not None,
        PER_BLOCK=per_block,
        SCALE_N=fmt.block_n if per_block else 1,
        SCALE_K=fmt.block_k if per_block else 1,
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )


def _check(x, router_logits, w13, w2, top_k, fp8=None):
    if x.dim() != 2 or router_logits.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            "fused_moe needs x [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I]"
        )
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if router_logits.shape != (t, e) or h13 != h or two_i % 2:
        raise ValueError(
            f"fused_moe shapes disagree: x {tuple(x.shape)}, router_logits "
            f"{tuple(router_logits.shape)}, w13 {tuple(w13.shape)}"
        )
    if w2.shape != (e, h, two_i // 2):
        raise ValueError(f"w2 must be [E, H, I] = {(e, h, two_i // 2)}, got {tuple(w2.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    weight_dtype = x.dtype if fp8 is None else w13.dtype
    if x.dtype not in MOE_DTYPES or w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(
            f"fused_moe supports fp32/fp16/bf16 x and weights of one dtype (or FP8 weights "
            f"with fp8=Fp8Experts), got {x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if fp8 is not None:
        _check_fp8(fp8, w13, w2, e, h, two_i // 2)


def _check_fp8(fp8, w13, w2, e, h, inter):
    fmt = fp8.fmt
    if w13.dtype not in FP8_DTYPES or w2.dtype != w13.dtype:
        raise ValueError(f"FP8 experts need FP8 w13 and w2, got {w13.dtype}, {w2.dtype}")
    if not experts_fit_fp8(fmt, h, inter):
        raise ValueError(
            f"FP8 experts need channel scales, or block ones whose blocks tile H {h} and "
            f"I {inter}, got {fmt}"
        )
    if fmt.granularity == "block" and (fmt.block_k & (fmt.block_k - 1) or fmt.block_k < 16):
        raise ValueError(f"the FP8 MoE GEMMs need a power-of-two block_k >= 16, not {fmt.block_k}")
    want13, want2 = expert_scale_shapes(fmt, e, h, inter)
    if tuple(fp8.w13_scale.shape) != want13 or tuple(fp8.w2_scale.shape) != want2:
        raise ValueError(
            f"FP8 expert scales must be w13 {want13} and w2 {want2}, got "
            f"{tuple(fp8.w13_scale.shape)} and {tuple(fp8.w2_scale.shape)}"
        )


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    config: dict | None = None,
    fp8: Fp8Experts | None = None,
) -> torch.Tensor:
    """KernelBackend.fused_moe: x [T, H], router_logits [T, E], w13 [E, 2I, H] (gate
    rows, then up rows), w2 [E, H, I] -> [T, H] in x's dtype. Any strides; fp32
    accumulation. config: launch settings (keys CONFIG_KEYS, or a GEMV config),
    moe_config.default_launch's when None. fp8: FP8 w13 / w2 with block or channel
    scales (fp8.Fp8Experts), computed W8A8 as the module doc says."""
    _check(x, router_logits, w13, w2, top_k, fp8)
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if t == 0 or h == 0 or inter == 0:
        return torch.zeros_like(x)
    check_device(_moe_gemm_kernel, x, router_logits, w13, w2)
    cfg = _check_config(dict(config or default_launch(t, e, h, inter, top_k, w13.dtype)))
    if cfg.get("kernel") == "gemv":
        if fp8 is not None:
            raise ValueError("the MoE GEMV path (moe_gemv.py) has no FP8 weights")
        return fused_moe_gemv(x, router_logits, w13, w2, top_k, renormalize, cfg)

    weights, _, *align = route_and_align(router_logits, top_k, renormalize, cfg["BLOCK_M"], x.dtype)
    m = t * top_k
    upcast = is_interpreted(_moe_gemm_kernel) and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"

    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if fp8 is not None:
        xq, xs = quantize_activation(x, fp8.fmt.act_group(h), w13.dtype)
        _moe_gemm(xq, w13, act, None, align, top_k, True, cfg, None, False,
                  (xs, fp8.w13_scale, fp8.fmt))  # fmt: skip
        aq, a_s = quantize_activation(act, fp8.fmt.act_group(inter), w2.dtype)
        _moe_gemm(aq, w2, out, weights, align, 1, False, cfg, None, False,
                  (a_s, fp8.w2_scale, fp8.fmt))  # fmt: skip
    else:
        _moe_gemm(x, w13, act, None, align, top_k, True, cfg, precision, upcast)
        _moe_gemm(act, w2, out, weights, align, 1, False, cfg, precision, upcast)
    if top_k == 1:
        return out
    return out.view(t, top_k, h).sum(dim=1)
