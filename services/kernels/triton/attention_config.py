"""Launch configuration of the paged-attention kernel (attention.py): tile sizes, key
splits, warps and stages from shapes and host-side ints only, so a configuration never
needs a device sync and a captured CUDA graph keeps its own."""

from __future__ import annotations

import triton

from services.kernels.triton._launch import next_pow2


def attention_config(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    interpreted: bool,
    num_splits: int | None = None,
    overrides: dict | None = None,
    smem: tuple[int, int, int, int] | None = None,
    kv_fp8: bool = False,
) -> dict:
    """Tile sizes and split count from shapes and host-side ints only (no sync).
    `overrides` replaces any of BLOCK_M, TILE_N, NUM_SPLITS, num_warps, num_stages
    (for tuning sweeps; BLOCK_M must stay >= max(16, Q_PER_KV), powers of two).
    smem = (head_dim, q bytes, kv bytes, the GPU's shared memory per program): tiles
    the overrides leave free shrink until the program fits (fp32 at head_dim 128 would
    not)."""
    overrides = overrides or {}
    q_per_kv = num_q_heads // num_kv_heads
    min_m = max(16, next_pow2(q_per_kv))  # tl.dot needs >= 16 rows
    if "BLOCK_M" in overrides:
        block_m = max(min_m, next_pow2(overrides["BLOCK_M"]))
    elif max_query_len >= 128:
        block_m = max(min_m, 128)
    elif max_query_len * q_per_kv >= 64:
        block_m = max(min_m, 64)
    else:
        block_m = min_m
    block_q = block_m // q_per_kv
    tile_n = overrides.get("TILE_N", 32 if interpreted else 64)
    num_splits = overrides.get("NUM_SPLITS", num_splits)
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = 1
        programs = num_q_blocks * num_kv_heads
        max_tiles = triton.cdiv(max(max_seq_len, 1), tile_n)
        target = 2 * num_sms
        if not interpreted and max_query_len <= block_q and programs < target and max_tiles >= 4:
            want = next_pow2(triton.cdiv(target, programs))
            cap = 1 << (max_tiles.bit_length() - 1)  # keep every split non-empty
            num_splits = max(1, min(want, cap, 64))
    num_splits = next_pow2(num_splits)
    # Launch settings from the H200 sweep (benchmarks/kernels_bench.py --sweep, bf16,
    # Llama-3-8B heads). Memory-bound programs (long key walks per program; or a big
    # prefill tile shared with many decode rows, whose programs are mostly empty rows
    # streaming keys) like wider key tiles and 8 warps; uniform prefill likes 4 warps
    # and a deeper pipeline; short decode walks 64 / 4 / 2.
    num_warps, num_stages = 4, 2
    wide = not interpreted and "TILE_N" not in overrides
    if block_m >= 128:
        num_stages = 3
        mixed = num_seqs * max_query_len >= 2 * num_tokens  # ragged: decode rows + chunks
        if wide and mixed:
            tile_n, num_warps = 128, 8
    elif wide and max_seq_len >= 2048 * num_splits:
        # FP8 caches convert every K and V tile in registers: with 8 warps that ran at
        # half the speed of 4 warps and a 3-stage pipeline (H200, 128 x 4k keys)
        tile_n, num_warps = 128, 8
        if kv_fp8:
            num_warps, num_stages = 4, 3
    num_stages = overrides.get("num_stages", num_stages)
    if smem is not None and smem[3]:
        head_dim, q_bytes, kv_bytes, limit = smem
        d = next_pow2(max(16, head_dim))

        def need(m, n, stages):  # the Q tile, K and V tiles per pipeline stage, slack
            return d * (m * q_bytes + stages * 2 * n * kv_bytes) + 1024

        while need(block_m, tile_n, num_stages) > limit:
            if "num_stages" not in overrides and num_stages > 1:
                num_stages -= 1
            elif "TILE_N" not in overrides and tile_n > 16:
                tile_n //= 2
            elif "BLOCK_M" not in overrides and block_m > min_m:
                block_m //= 2
            else:
                break  # nothing left to shrink: Triton names the overflow
        if block_q != block_m // q_per_kv:
            block_q = block_m // q_per_kv
            num_q_blocks = num_tokens // block_q + num_seqs
            if max_query_len > block_q and "NUM_SPLITS" not in overrides:
                num_splits = 1  # splitting keys needs each query row in one q block
    return dict(
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        num_q_blocks=num_q_blocks,
        num_warps=overrides.get("num_warps", num_warps),
        num_stages=num_stages,
    )
