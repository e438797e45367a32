"""Fused MoE for a handful of (token, expert) pairs: GEMVs, no alignment.

At decode batch sizes a MoE layer is a pass over the chosen experts' weights, so only
bandwidth counts. The tiled kernel (moe.py) groups pairs into BLOCK_M-row tiles per
expert first (routing + alignment), and with one token it launches only
experts x N-blocks programs (Qwen3-30B-A3B: 8 x 12 = 96 on a 132-SM H200), too few to
keep HBM busy. Here each pair streams its expert's rows directly:

1. routing: softmax in fp32, the top_k, optional renormalize -> weights [T * k] (x's
   dtype), ids [T * k]. Up to 128 experts by rank (`_route_rank_kernel`: one program
   per token, an [E, E] comparison ranks every expert at once), else moe_align's
   `_route_chunk` (K dependent max passes). On an H200 at Qwen3-30B-A3B batch 1 the
   rank kernel took the step from 2.86-2.87 to 2.84 ms; routing inside the gate/up
   kernel instead (every program ranking its token) made it 3.06 ms;
2. gate/up (`_gated_kernel`, grid pairs x cdiv(I, BLOCK_N)): fp32 FMAs of x's row
   with the expert's gate and up rows, silu(gate) * up -> act [M, I] in x's dtype;
3. down and sum (`_down_sum_kernel`, grid T x H / BLOCK_N): a program takes all k
   pairs of one token for BLOCK_N output rows as one [k, BLOCK_N, BLOCK_K] tile per
   step, so every pair's loads are in flight together; each pair's row is scaled by
   its routing weight and rounded to x's dtype (as moe.py rounds each pair's row),
   then the k rows are summed in fp32 -> out [T, H]. No atomics: deterministic. (A
   program walking its k pairs one after the other kept too few loads in flight; a
   program per pair and a separate sum launch was 10-15% slower on an H200.)

Same semantics as moe.py's fused_moe; picked by the tuner (a config with
"kernel": "gemv") where it is faster, i.e. decode batches. No host synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import (
    check_device,
    is_interpreted,
    next_pow2,
    pdl_sync,
    use_pdl,
)
from services.kernels.triton.gemv import check_k_fold, folded
from services.kernels.triton.moe_align import _route_chunk

GEMV_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps")
# optional: K tiles in flight in the gate/up and the down kernel's K loops (cp.async
# into shared memory; 1, the default: plain loads, one tile in flight)
GEMV_STAGE_KEYS = ("num_stages", "down_num_stages")
# optional: "k_fold", the gate/up kernel's adjacent columns summed in registers before
# they join its fp32 partial tiles (gemv.GemvConfig.k_fold): wider K tiles, same registers
# Beyond this many pairs experts are shared by several tokens, and the tiled kernel
# reads each expert once where GEMVs would read it per pair.
GEMV_MAX_PAIRS = 64
_ROUTE_SUB_T = 16  # tokens per routing step (one program per 16 tokens)
# Routing by rank up to this many experts: an [E, E] comparison per token fits one
# program's registers (128: 64 values a thread at 4 warps); more take the top-k passes.
RANK_MAX_EXPERTS = 128


def default_gemv_config(num_tokens: int, E: int, H: int, I: int, top_k: int) -> dict:  # noqa: E741
    """Narrow N blocks so the gate/up kernel launches a few programs per SM at one
    token (the down kernel takes one output row per program, whatever the config)."""
    return {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": min(256, next_pow2(max(H, 16))),
            "num_warps": 4}  # fmt: skip


def check_gemv_config(cfg: dict) -> dict:
    missing = [k for k in GEMV_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"fused_moe gemv config lacks {missing}")
    for key, low in (("BLOCK_N", 1), ("BLOCK_K", 16)):
        v = cfg[key]
        if not isinstance(v, int) or v < low or v & (v - 1):
            raise ValueError(f"{key} must be a power of two >= {low}, got {v!r}")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']!r}")
    for key in GEMV_STAGE_KEYS:
        stages = cfg.get(key, 1)
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"{key} must be a positive int, got {stages!r}")
    check_k_fold(cfg.get("k_fold", 1), cfg["BLOCK_K"])
    return cfg


@triton.jit
def _route_kernel(
    logits_ptr, stride_lt, stride_le, weights_ptr, ids_ptr, T, E,
    K: tl.constexpr, K_P: tl.constexpr, RENORMALIZE: tl.constexpr, SUB_T: tl.constexpr,
    E_P: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    t_start = tl.program_id(0) * SUB_T
    _route_chunk(
        logits_ptr, stride_lt, stride_le, weights_ptr, ids_ptr, t_start,
        tl.minimum(t_start + SUB_T, T), E, K, K_P, RENORMALIZE, SUB_T, E_P,
    )  # fmt: skip


@triton.jit
def _rank_route(logits_ptr, stride_le, E, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                E_P: tl.constexpr):  # fmt: skip
    """One token's routing by rank: rank[e] = the experts ahead of e (a larger logit, or
    an equal one at a lower index), so slot s holds the expert of rank s, as the
    repeated-max top-k picks it, in one [E_P, E_P] comparison and one sum instead of K
    dependent max/min passes. Returns (rank [E_P] int32, weight [E_P] fp32: the
    expert's routing weight, 0 outside the top K)."""
    e_idx = tl.arange(0, E_P)
    e_ok = e_idx < E
    lg = tl.load(logits_ptr + e_idx * stride_le, mask=e_ok, other=float("-inf")).to(tl.float32)
    lj = lg[:, None]
    le = lg[None, :]
    ahead = (lj > le) | ((lj == le) & (e_idx[:, None] < e_idx[None, :]))
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    p = tl.where(e_ok, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
    weight = tl.where(e_ok & (rank < K), p / tl.sum(p, axis=0), 0.0)
    if RENORMALIZE:
        weight = weight / tl.sum(weight, axis=0)
    return rank, weight


@triton.jit
def _route_rank_kernel(
    logits_ptr, stride_lt, stride_le, weights_ptr, ids_ptr, E,
    K: tl.constexpr, K_P: tl.constexpr, RENORMALIZE: tl.constexpr, E_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    rank, weight = _rank_route(logits_ptr + token * stride_lt, stride_le, E, K, RENORMALIZE, E_P)
    e_idx = tl.arange(0, E_P)
    slots = tl.arange(0, K_P)
    chosen = rank[None, :] == slots[:, None]  # [K_P, E_P]
    ids = tl.sum(tl.where(chosen, e_idx[None, :], 0), axis=1)
    w = tl.sum(tl.where(chosen, weight[None, :], 0.0), axis=1)
    ok = slots < K
    tl.store(ids_ptr + token * K + slots, ids, mask=ok)
    tl.store(weights_ptr + token * K + slots, w.to(weights_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, H, INTER,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)  # the expert comes from the routing kernel: nothing to load before
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # out-of-range rows re-read row 0
    gate_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    up_ptrs = gate_ptrs + INTER * stride_wn
    x_row = x_ptr + token * stride_xt
    gate = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_row + offs_k * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(gate_ptrs + offs_k[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
        wu = tl.load(up_ptrs + offs_k[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
        gate += folded(wg.to(tl.float32) * x[None, :], FOLD)
        up += folded(wu.to(tl.float32) * x[None, :], FOLD)
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        act_ptr + pair.to(tl.int64) * INTER + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok
    )


@triton.jit
def _down_sum_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, H, INTER,
    stride_we, stride_wn, stride_wk, stride_ot, stride_oh,
    TOP_K: tl.constexpr, K_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    slots = tl.arange(0, K_P)
    s_ok = slots < TOP_K
    pairs = token * TOP_K + tl.where(s_ok, slots, 0)  # padding slots re-read slot 0
    experts = tl.load(ids_ptr + pairs).to(tl.int64)
    w_ptrs = w_ptr + experts[:, None, None] * stride_we + rows[None, :, None] * stride_wn
    a_rows = act_ptr + pairs[:, None] * INTER
    acc = tl.zeros([K_P, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(a_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + offs_k[None, None, :] * stride_wk, mask=k_ok[None, None, :],
                    other=0.0)  # fmt: skip
        acc += w.to(tl.float32) * a[:, None, :]
    weight = tl.load(weights_ptr + pairs, mask=s_ok, other=0.0).to(tl.float32)
    # each pair's row rounded to x's dtype, as the tiled kernel stores it, then summed
    part = (tl.sum(acc, axis=2) * weight[:, None]).to(out_ptr.dtype.element_ty)
    total = tl.sum(tl.where(s_ok[:, None], part.to(tl.float32), 0.0), axis=0)
    tl.store(out_ptr + token * stride_ot + offs_n * stride_oh,
             total.to(out_ptr.dtype.element_ty), mask=n_ok)  # fmt: skip


def fused_moe_gemv(x, router_logits, w13, w2, top_k: int, renormalize: bool, config: dict):
    """moe.fused_moe's contract (checked there) for a config with "kernel": "gemv"."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    check_device(_gated_kernel, x, router_logits, w13, w2)
    cfg = check_gemv_config(config)
    m = t * top_k
    weights = torch.empty(m, dtype=x.dtype, device=x.device)
    ids = torch.empty(m, dtype=torch.int32, device=x.device)
    pdl = use_pdl(x)
    e_p = next_pow2(max(e, 2))
    lt, le = router_logits.stride(0), router_logits.stride(1)
    if e_p <= RANK_MAX_EXPERTS:
        _route_rank_kernel[(t,)](
            router_logits, lt, le, weights, ids, e, K=top_k, K_P=next_pow2(top_k),
            RENORMALIZE=renormalize, E_P=e_p, USE_PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    else:
        _route_kernel[(triton.cdiv(t, _ROUTE_SUB_T),)](
            router_logits, lt, le, weights, ids, t, e, K=top_k, K_P=next_pow2(top_k),
            RENORMALIZE=renormalize, SUB_T=_ROUTE_SUB_T, E_P=e_p, USE_PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    block_n, block_k, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    _gated_kernel[(m, triton.cdiv(inter, block_n))](
        x, w13, act, ids, h, inter, x.stride(0), x.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg.get("num_stages", 1),
        FOLD=min(cfg.get("k_fold", 1), block_k), num_warps=warps, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    # one output row per program, whatever the gate/up tile (H200: best or within 2%
    # of the best of 1-8 rows x 64-256 columns x 4-8 warps at Qwen3-30B-A3B's and
    # Mixtral's experts, 1-8 tokens)
    down_n, down_k = 1, 256 if inter >= 4096 else 128
    if is_interpreted(_down_sum_kernel):  # the interpreter pays per program
        down_n = min(64, next_pow2(h))
    _down_sum_kernel[(t, triton.cdiv(h, down_n))](
        act, w2, out, ids, weights, h, inter, w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), TOP_K=top_k, K_P=next_pow2(top_k), BLOCK_N=down_n,
        BLOCK_K=min(down_k, next_pow2(max(inter, 16))), NUM_STAGES=cfg.get("down_num_stages", 1),
        USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
