"""The MoE router's GEMV with the top-k routing done by its last program.

At decode batch sizes the router is a small GEMV (Qwen3-30B-A3B: 128 experts x 2048)
and the routing a one-program kernel after it (moe_gemv._route_rank_kernel): two
launches, the second of which mostly waits for the first. Here each program computes
BLOCK_N of one token's logits and stores them in x's dtype, as the linear returns them,
then counts itself in on the token's arrival counter. The program that arrives last
ranks the token's experts from the stored logits (moe_gemv.rank_logits) and writes the
routing, then zeroes the counter for the next launch. The routing equals the linear's
logits through moe_gemv's routing, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import check_device, next_pow2, pdl_sync, use_pdl
from services.kernels.triton.moe_gemv import RANK_MAX_EXPERTS, rank_logits, store_routing

# "gemv" routes in the router's GEMV where the MoE takes the GEMV path; "separate" (the
# default until timed on a GPU) runs the router as a linear and then a routing kernel
MOE_ROUTE_ENV = "PDSERVE_TRITON_MOE_ROUTE"
_BLOCK_N = 2  # logits per program: 64 programs for 128 experts (the best router GEMV tile)
_MAX_BLOCK_K = 2048


@triton.jit
def _gate_route_kernel(
    x_ptr, w_ptr, logits_ptr, counters_ptr, weights_ptr, ids_ptr, H, E,
    stride_xt, stride_xh, stride_we,
    K: tl.constexpr, K_P: tl.constexpr, RENORMALIZE: tl.constexpr, E_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % E).to(tl.int64)  # rows past E re-read valid ones, never stored
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_we + offs_k[None, :]
    x_row = x_ptr + token * stride_xt
    pdl_sync(USE_PDL)
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        x = tl.load(x_row + (k0 + offs_k) * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32)
        part += w * x[None, :]
    logits_row = logits_ptr + token * E
    logits = tl.sum(part, axis=1).to(logits_ptr.dtype.element_ty)
    tl.store(logits_row + offs_n, logits, mask=offs_n < E)
    tl.debug_barrier()  # every thread's logits are stored before the count says so
    counter = counters_ptr + token
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:  # the other programs' logits are visible now
        tl.atomic_xchg(counter, 0)  # zero again for the next launch (graph replays)
        e_idx = tl.arange(0, E_P)
        # stored by other programs: read past L1 (.cg), which may hold an earlier launch's
        lg = tl.load(logits_row + e_idx, mask=e_idx < E, other=float("-inf"),
                     cache_modifier=".cg")  # fmt: skip
        rank, weight = rank_logits(lg, E, K, RENORMALIZE, E_P)
        store_routing(weights_ptr, ids_ptr, token, rank, weight, K, K_P, E_P)


def can_gate_route(x: torch.Tensor, gate: torch.nn.Module) -> bool:
    """Whether gate_route takes this router: a bias-free [E <= 128, H] weight in x's
    dtype (routers ship unquantized and without a bias)."""
    w = getattr(gate, "weight", None)
    return (
        isinstance(w, torch.Tensor)
        and getattr(gate, "bias", None) is None
        and w.dim() == 2
        and w.dtype == x.dtype
        and w.stride(1) == 1
        and w.shape[1] == x.shape[1]
        and next_pow2(max(w.shape[0], 2)) <= RANK_MAX_EXPERTS
    )


def route_counters(workspace: dict, tokens: int, device) -> torch.Tensor:
    """The arrival counters, one per token: zero before every launch. Every launch
    leaves them zero, so the backend keeps one tensor (grown when a launch has more
    tokens); allocated inside a graph capture, its zeroing is part of that graph."""
    counters = workspace.get("gate_route_counters")
    if counters is None or counters.numel() < tokens or counters.device != device:
        counters = torch.zeros(max(tokens, 64), dtype=torch.int32, device=device)
        workspace["gate_route_counters"] = counters
    return counters


def gate_route(x, gate_weight, top_k: int, renormalize: bool, workspace: dict):
    """x [T, H] through the router's weight [E, H] (logits rounded to x's dtype, as a
    linear returns them) and moe_gemv's routing -> (weights [T * top_k] in x's dtype,
    ids [T * top_k] int32, the logits [T, E]), in one launch."""
    t, h = x.shape
    e = gate_weight.shape[0]
    check_device(_gate_route_kernel, x, gate_weight)
    m = t * top_k
    weights = torch.empty(m, dtype=x.dtype, device=x.device)
    ids = torch.empty(m, dtype=torch.int32, device=x.device)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    counters = route_counters(workspace, t, x.device)
    pdl = use_pdl(x)
    _gate_route_kernel[(triton.cdiv(e, _BLOCK_N), t)](
        x, gate_weight, logits, counters, weights, ids, h, e,
        x.stride(0), x.stride(1), gate_weight.stride(0),
        K=top_k, K_P=next_pow2(top_k), RENORMALIZE=renormalize, E_P=next_pow2(max(e, 2)),
        BLOCK_N=_BLOCK_N, BLOCK_K=min(_MAX_BLOCK_K, next_pow2(max(h, 16))), USE_PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids, logits
