"""Routing and token-expert alignment for the fused MoE (moe.py), in Triton with no
host synchronisation: softmax in fp32, the top_k largest, optional renormalize (as the
torch backend's select_experts), then the (token, expert) pairs grouped by expert, in
token order inside an expert, each group padded to a multiple of BLOCK_M. Every output
shape depends on (T, top_k, E, BLOCK_M) only, so a CUDA graph can hold it. One launch
for decode batches, three for larger ones (`align_plan`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton._launch import next_pow2, pdl_sync, use_pdl


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(rows of sorted_ids, tiles): static for a given (T * top_k, E, BLOCK_M)."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    tiles = triton.cdiv(rows, block_m)
    return tiles * block_m, tiles


# ---- routing and alignment -----------------------------------------------------------
#
# The tokens are cut into chunks of CHUNK_T tokens. Per chunk (one program each):
# softmax and top-k of its router logits, the pair ids / weights, its per-expert pair
# counts, and its share of the padding fill of sorted_ids. Then, in one program: each
# expert's padded end row, the valid tile count, and each chunk's first row per
# expert (the expert's start plus the earlier chunks' counts). Last, per chunk: its
# share of the tile experts, and each of its pairs goes to the chunk's first row for
# its expert plus its rank among the chunk's earlier pairs of that expert (pairwise
# comparisons in steps of SUB_P pairs; no scans, no atomics), which keeps each
# expert's pairs in token order: deterministic. One chunk (decode batches) runs all
# of it in one program; more chunks take three launches.


@triton.jit
def _route_chunk(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,  # [T * K], x's dtype
    ids_ptr,  # [T * K] int32
    t_start,
    t_end,
    E,
    K: tl.constexpr,
    K_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SUB_T: tl.constexpr,
    E_P: tl.constexpr,
):
    """Routes tokens [t_start, t_end); returns their per-expert pair counts [E_P]."""
    e_idx = tl.arange(0, E_P)
    e_ok = e_idx < E
    k_idx = tl.arange(0, K_P)
    counts = tl.zeros([E_P], dtype=tl.int32)
    for t0 in range(t_start, t_end, SUB_T):
        rows = t0 + tl.arange(0, SUB_T)
        t_ok = rows < t_end
        lg = tl.load(
            logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + e_idx[None, :] * stride_le,
            mask=t_ok[:, None] & e_ok[None, :],
            other=float("-inf"),
        ).to(tl.float32)
        row_max = tl.where(t_ok, tl.max(lg, axis=1), 0.0)  # rows past the end: all -inf
        denom = tl.sum(tl.where(e_ok[None, :], tl.exp(lg - row_max[:, None]), 0.0), axis=1)
        denom = tl.where(t_ok, denom, 1.0)
        taken = tl.broadcast_to((e_idx >= E)[None, :], [SUB_T, E_P])  # padding columns
        w_tile = tl.zeros([SUB_T, K_P], dtype=tl.float32)
        id_tile = tl.zeros([SUB_T, K_P], dtype=tl.int32)
        for s in tl.static_range(K):
            # the largest logit not yet taken (the lowest index among equals)
            best = tl.max(tl.where(taken, float("-inf"), lg), axis=1)
            hit = (lg == best[:, None]) & ~taken
            idx = tl.min(tl.where(hit, e_idx[None, :], E_P), axis=1)
            chosen = e_idx[None, :] == idx[:, None]
            taken = taken | chosen
            prob = tl.exp(best - row_max) / denom
            w_tile = tl.where(k_idx[None, :] == s, prob[:, None], w_tile)
            id_tile = tl.where(k_idx[None, :] == s, idx[:, None], id_tile)
        counts += tl.sum((taken & t_ok[:, None] & e_ok[None, :]).to(tl.int32), axis=0)
        if RENORMALIZE:
            w_tile = w_tile / tl.where(t_ok, tl.sum(w_tile, axis=1), 1.0)[:, None]
        offs = rows[:, None] * K + k_idx[None, :]
        ok = t_ok[:, None] & (k_idx < K)[None, :]
        tl.store(weights_ptr + offs, w_tile.to(weights_ptr.dtype.element_ty), mask=ok)
        tl.store(ids_ptr + offs, id_tile, mask=ok)
    return counts


@triton.jit
def _tile_experts(
    padded_end,  # [E_P] int32: inclusive cumsum of the padded counts
    tile_expert_ptr,
    j_start,
    j_end,
    E,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
    SUB_J: tl.constexpr,
):
    """tile_expert[j] for tiles [j_start, j_end): the experts whose rows end at or
    before the tile's first row, counted (past the valid tiles: E - 1)."""
    e_ok = tl.arange(0, E_P) < E
    for j0 in range(j_start, j_end, SUB_J):  # [SUB_J, E_P] comparisons per step
        j = j0 + tl.arange(0, SUB_J)
        ends_before = (padded_end[None, :] <= (j * BLOCK_M)[:, None]) & e_ok[None, :]
        expert = tl.minimum(tl.sum(ends_before.to(tl.int32), axis=1), E - 1)
        tl.store(tile_expert_ptr + j, expert, mask=j < j_end)


@triton.jit
def _fill(ptr, value, r_start, r_end, FILL: tl.constexpr):
    for r0 in range(r_start, r_end, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(ptr + r, tl.full([FILL], 0, tl.int32) + value, mask=r < r_end)


@triton.jit
def _store_num_valid(padded_end, num_valid_ptr, E, BLOCK_M: tl.constexpr, E_P: tl.constexpr):
    e_ok = tl.arange(0, E_P) < E
    tl.store(num_valid_ptr, tl.max(tl.where(e_ok, padded_end, 0), axis=0) // BLOCK_M)


@triton.jit
def _scatter_chunk(
    ids_ptr,
    sorted_ids_ptr,
    dest,  # [E_P] int32: the first row of this chunk's pairs of each expert
    p_start,
    p_end,
    SUB_P: tl.constexpr,
    E_P: tl.constexpr,
):
    e_idx = tl.arange(0, E_P)
    i = tl.arange(0, SUB_P)
    for p0 in range(p_start, p_end, SUB_P):
        pairs = p0 + i
        p_ok = pairs < p_end
        ex = tl.load(ids_ptr + pairs, mask=p_ok, other=E_P)  # E_P matches no expert
        # rank among the step's earlier pairs of the same expert (pairwise, no scan)
        earlier = (ex[:, None] == ex[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        hot = ex[:, None] == e_idx[None, :]
        base = tl.sum(tl.where(hot, dest[None, :], 0), axis=1)
        tl.store(sorted_ids_ptr + base + rank, pairs, mask=p_ok)
        dest += tl.sum(hot.to(tl.int32), axis=0)


@triton.jit
def _padded_end(counts, BLOCK_M: tl.constexpr):
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return tl.cumsum(padded, axis=0), padded


@triton.jit
def _route_align_fused_kernel(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,
    ids_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_valid_ptr,
    T,
    E,
    rows,
    tiles,
    K: tl.constexpr,
    K_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_T: tl.constexpr,
    SUB_P: tl.constexpr,
    E_P: tl.constexpr,
    SUB_J: tl.constexpr,
    FILL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """All of it in one program (one chunk): decode-sized batches."""
    pdl_sync(USE_PDL)
    counts = _route_chunk(
        logits_ptr, stride_lt, stride_le, weights_ptr, ids_ptr, 0, T, E,
        K, K_P, RENORMALIZE, SUB_T, E_P,
    )  # fmt: skip
    padded_end, padded = _padded_end(counts, BLOCK_M)
    _store_num_valid(padded_end, num_valid_ptr, E, BLOCK_M, E_P)
    _tile_experts(padded_end, tile_expert_ptr, 0, tiles, E, BLOCK_M, E_P, SUB_J)
    _fill(sorted_ids_ptr, T * K, 0, rows, FILL)
    tl.debug_barrier()  # the ids and the padding fill, written by other threads
    _scatter_chunk(ids_ptr, sorted_ids_ptr, padded_end - padded, 0, T * K, SUB_P, E_P)


@triton.jit
def _route_count_kernel(
    logits_ptr,
    stride_lt,
    stride_le,
    weights_ptr,
    ids_ptr,
    counts_ptr,  # [num_chunks, E_P] int32
    sorted_ids_ptr,
    T,
    E,
    CHUNK_T,
    rows,
    ROWS_PER_CHUNK,
    K: tl.constexpr,
    K_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SUB_T: tl.constexpr,
    E_P: tl.constexpr,
    FILL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    c = tl.program_id(0)
    r_start = c * ROWS_PER_CHUNK  # this chunk's share of the padding fill
    _fill(sorted_ids_ptr, T * K, r_start, tl.minimum(r_start + ROWS_PER_CHUNK, rows), FILL)
    t_start = c * CHUNK_T
    counts = _route_chunk(
        logits_ptr, stride_lt, stride_le, weights_ptr, ids_ptr, t_start,
        tl.minimum(t_start + CHUNK_T, T), E, K, K_P, RENORMALIZE, SUB_T, E_P,
    )  # fmt: skip
    tl.store(counts_ptr + c * E_P + tl.arange(0, E_P), counts)


@triton.jit
def _align_offsets_kernel(
    counts_ptr,  # [num_chunks, E_P] int32: each chunk's pairs per expert, then its first rows
    padded_end_ptr,  # [E_P] int32 out
    num_valid_ptr,
    num_chunks,
    E,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
    SUB_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    e_idx = tl.arange(0, E_P)
    total = tl.zeros([E_P], dtype=tl.int32)
    for c0 in range(0, num_chunks, SUB_C):
        cs = c0 + tl.arange(0, SUB_C)
        ptrs = counts_ptr + cs[:, None] * E_P + e_idx[None, :]
        total += tl.sum(tl.load(ptrs, mask=(cs < num_chunks)[:, None], other=0), axis=0)
    padded_end, padded = _padded_end(total, BLOCK_M)
    tl.store(padded_end_ptr + e_idx, padded_end)
    _store_num_valid(padded_end, num_valid_ptr, E, BLOCK_M, E_P)
    # each chunk's first row per expert: the expert's start plus the earlier chunks'
    # counts, an exclusive prefix over chunks taken as a strictly-lower-triangular
    # matmul (exact: the counts are integers <= CHUNK_T <= 2048, fp32 sums)
    carry = padded_end - padded
    ci = tl.arange(0, SUB_C)
    tril = (ci[None, :] < ci[:, None]).to(tl.float16)
    for c0 in range(0, num_chunks, SUB_C):
        cs = c0 + ci
        ptrs = counts_ptr + cs[:, None] * E_P + e_idx[None, :]
        ok = (cs < num_chunks)[:, None]
        cnt = tl.load(ptrs, mask=ok, other=0)
        before = tl.dot(tril, cnt.to(tl.float16), out_dtype=tl.float32).to(tl.int32)
        tl.store(ptrs, before + carry[None, :], mask=ok)
        carry += tl.sum(cnt, axis=0)


@triton.jit
def _align_scatter_kernel(
    ids_ptr,
    sorted_ids_ptr,
    first_ptr,  # [num_chunks, E_P]: each chunk's first row per expert
    padded_end_ptr,
    tile_expert_ptr,
    num_pairs,
    CHUNK_P,
    E,
    tiles,
    TILES_PER_CHUNK,
    BLOCK_M: tl.constexpr,
    SUB_P: tl.constexpr,
    E_P: tl.constexpr,
    SUB_J: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    c = tl.program_id(0)
    e_idx = tl.arange(0, E_P)
    j_start = c * TILES_PER_CHUNK  # this chunk's share of the tile experts
    _tile_experts(
        tl.load(padded_end_ptr + e_idx), tile_expert_ptr, j_start,
        tl.minimum(j_start + TILES_PER_CHUNK, tiles), E, BLOCK_M, E_P, SUB_J,
    )  # fmt: skip
    dest = tl.load(first_ptr + c * E_P + e_idx)
    p_start = c * CHUNK_P
    _scatter_chunk(
        ids_ptr, sorted_ids_ptr, dest, p_start, tl.minimum(p_start + CHUNK_P, num_pairs),
        SUB_P, E_P,
    )  # fmt: skip


_TILE_ELEMS = 4096  # [tokens, pairs or chunks, E_P] tiles per loop step


def align_plan(num_tokens: int, num_experts: int, top_k: int) -> dict:
    """How routing and alignment are cut: CHUNK_T tokens per chunk (one program each;
    about two scatter steps, at most 1024 chunks), SUB_T tokens per routing step,
    SUB_P pairs per scatter step. Each step's work is spread over the programs rather
    than looped in one: a program's steps are latency-bound."""
    e_p = max(16, next_pow2(num_experts))  # >= 16: the chunk prefix is a tl.dot
    sub_p = max(16, min(64, _TILE_ELEMS // e_p))  # [SUB_P, SUB_P] and [SUB_P, E_P] tiles
    chunk_t = next_pow2(triton.cdiv(2 * sub_p, top_k))
    chunk_t = max(chunk_t, next_pow2(triton.cdiv(num_tokens, 1024)))
    sub_t = max(2, min(next_pow2(num_tokens), chunk_t, _TILE_ELEMS // e_p))
    return dict(
        E_P=e_p,
        SUB_T=sub_t,
        SUB_P=sub_p,
        CHUNK_T=chunk_t,
        num_chunks=triton.cdiv(num_tokens, chunk_t),
        num_warps=4,
    )


def route_and_align(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    weight_dtype: torch.dtype,
    plan: dict | None = None,
):
    """Routing (softmax in fp32, the top_k largest, lowest expert first among equal
    logits, renormalized when asked) and the alignment of the T * top_k pairs into
    BLOCK_M tiles of one expert each. Returns
      weights [T * k] (weight_dtype), ids [T * k] (int32): pair p = t * k + slot;
      sorted_ids (int32 [rows]): pair indices grouped by expert, in token order inside
        an expert, each group padded to a multiple of block_m with T * k;
      tile_expert (int32 [tiles]): each tile's expert (past the valid tiles: E - 1);
      num_valid_tiles (int32 [1]).
    Shapes from align_sizes; no host synchronisation. plan: align_plan's by default."""
    t, e = router_logits.shape
    dev = router_logits.device
    m = t * top_k
    rows, tiles = align_sizes(m, e, block_m)
    plan = plan or align_plan(t, e, top_k)
    weights = torch.empty(m, dtype=weight_dtype, device=dev)
    ids = torch.empty(m, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    num_valid = torch.empty(1, dtype=torch.int32, device=dev)
    k_p = next_pow2(top_k)
    e_p, sub_t, sub_p = plan["E_P"], plan["SUB_T"], plan["SUB_P"]
    warps = plan["num_warps"]
    fill = 1024
    sub_j = max(16, _TILE_ELEMS // e_p)  # tiles per step of the tile-expert loop
    logits = (router_logits, router_logits.stride(0), router_logits.stride(1))
    pdl = use_pdl(router_logits)
    if plan["num_chunks"] == 1:
        _route_align_fused_kernel[(1,)](
            *logits, weights, ids, sorted_ids, tile_expert, num_valid, t, e, rows, tiles,
            K=top_k, K_P=k_p, RENORMALIZE=renormalize, BLOCK_M=block_m, SUB_T=sub_t,
            SUB_P=sub_p, E_P=e_p, SUB_J=sub_j, FILL=fill, num_warps=warps,
            USE_PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
        return weights, ids, sorted_ids, tile_expert, num_valid
    nc, chunk_t = plan["num_chunks"], plan["CHUNK_T"]
    if chunk_t > 2048:  # the chunk counts' prefix sums in fp16 matmuls stay exact
        raise ValueError(f"CHUNK_T must be <= 2048, got {chunk_t}")
    counts = torch.empty(nc, e_p, dtype=torch.int32, device=dev)
    padded_end = torch.empty(e_p, dtype=torch.int32, device=dev)
    _route_count_kernel[(nc,)](
        *logits, weights, ids, counts, sorted_ids, t, e, chunk_t, rows, triton.cdiv(rows, nc),
        K=top_k, K_P=k_p, RENORMALIZE=renormalize, SUB_T=sub_t, E_P=e_p, FILL=fill,
        num_warps=warps, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    _align_offsets_kernel[(1,)](
        counts, padded_end, num_valid, nc, e,
        BLOCK_M=block_m, E_P=e_p, SUB_C=max(16, min(64, _TILE_ELEMS // e_p)), num_warps=warps,
        USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    _align_scatter_kernel[(nc,)](
        ids, sorted_ids, counts, padded_end, tile_expert, m, chunk_t * top_k, e, tiles,
        triton.cdiv(tiles, nc), BLOCK_M=block_m, SUB_P=sub_p, E_P=e_p, SUB_J=sub_j,
        num_warps=warps, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids, sorted_ids, tile_expert, num_valid
