"""Launch configurations of the fused MoE's GEMMs (moe.py): the default per shape, the
neighbours the kernel tuner times, their validation, and the shared-memory fit, from
shapes and host-side ints only."""

from __future__ import annotations

import functools

import torch
import triton

from services.kernels.triton.moe_gemv import (
    GEMV_MAX_PAIRS,
    check_gemv_config,
    default_gemv_config,
)

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


_H200_SMEM = 232448  # bytes of shared memory a block may take on an H100 / H200


@functools.cache
def _smem_limit(device_index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # no GPU driver (the interpreter): the H200's
        return _H200_SMEM


def _current_smem_limit() -> int:
    if torch.cuda.is_available():
        return _smem_limit(torch.cuda.current_device())
    return _H200_SMEM


def default_config(
    num_tokens: int,
    E: int,
    H: int,
    I: int,  # noqa: E741
    top_k: int,
    dtype: torch.dtype,
) -> dict:
    """Launch settings for T = num_tokens tokens, from an H200 sweep (bf16,
    Qwen3-30B-A3B and Mixtral-8x7B experts, CUDA-graph replays). The pairs per expert
    (T * top_k / E on average) pick the tiles: decode-sized batches get 16-row tiles
    (the least tl.dot takes) and deep K tiles, as the GEMMs then only stream expert
    weights; prefill-sized ones get tall, wide tiles that reuse each weight tile over
    more rows. Stages (then BLOCK_K) shrink until the tiles fit in the current GPU's
    shared memory."""
    per_expert = num_tokens * top_k / max(E, 1)
    if per_expert < 1:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif per_expert <= 8:
        cfg = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    elif per_expert <= 32:
        cfg = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif per_expert <= 512:
        cfg = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return _fit_smem(cfg, dtype)


def default_launch(
    num_tokens: int,
    E: int,
    H: int,
    I: int,  # noqa: E741
    top_k: int,
    dtype: torch.dtype,
) -> dict:
    """What fused_moe runs without a tuned config: the GEMV path for a single token
    (bf16 on the H200, CUDA-graph replays, `benchmarks/moe_configs_bench.py`:
    Qwen3-30B-A3B experts 31.9 against 36.3 us for the best tiles, Mixtral's 185.6
    against 190.1), tiles otherwise (from 4 tokens on the tiles won at both shapes),
    and always for FP8 experts, which the GEMV path does not take."""
    if num_tokens == 1 and dtype.itemsize > 1:
        return default_gemv_config(num_tokens, E, H, I, top_k)
    return default_config(num_tokens, E, H, I, top_k, dtype)


def _smem_bytes(cfg: dict, dtype: torch.dtype) -> int:
    """GEMM 1's A tile plus gate and up tiles, per stage."""
    esize = dtype.itemsize
    return cfg["num_stages"] * (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * esize


def _fit_smem(cfg: dict, dtype: torch.dtype) -> dict:
    """Fewer stages, then shallower K tiles, until the tiles fit this GPU's shared memory."""
    limit = _current_smem_limit()
    while _smem_bytes(cfg, dtype) > limit and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while _smem_bytes(cfg, dtype) > limit and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    return cfg


def candidate_configs(
    num_tokens: int,
    E: int,
    H: int,
    I: int,  # noqa: E741
    top_k: int,
    dtype: torch.dtype,
    limit: int = 4,
) -> list[dict]:
    """What the kernel tuner times per shape class on the running GPU: default_config
    first, then single-step neighbours of it (taller M tiles once experts get many
    rows, wider / narrower N tiles, the other K depth, the other warp count), fitted
    to shared memory, without duplicates, `limit` of them; for at most GEMV_MAX_PAIRS
    pairs also three settings of the GEMV path (moe_gemv.py: its default, a narrower
    and deeper tile, and its K loops pipelined), unless dtype (the weights')
    is FP8, which the GEMV path does not take. A handful only: each is a
    compilation of both kernels on a worker's first start on a machine (~3 s on an
    H200)."""
    base = default_config(num_tokens, E, H, I, top_k, dtype)
    steps = [
        {},
        {"BLOCK_N": base["BLOCK_N"] * 2},
        {"BLOCK_N": max(16, base["BLOCK_N"] // 2)},
        {"BLOCK_K": 128 if base["BLOCK_K"] < 128 else 64},
        {"num_warps": 8 if base["num_warps"] == 4 else 4},
    ]
    if num_tokens * top_k / max(E, 1) > 32:
        steps.insert(1, {"BLOCK_M": base["BLOCK_M"] * 2})
    out: list[dict] = []
    for step in steps:
        cfg = _fit_smem({**base, **step}, dtype)
        if cfg not in out:
            out.append(cfg)
    out = out[:limit]
    fp8 = dtype.itemsize == 1  # FP8 experts: no GEMV path
    if num_tokens * top_k <= GEMV_MAX_PAIRS and not fp8:  # decode batches: the GEMV path too
        gemv = default_gemv_config(num_tokens, E, H, I, top_k)
        out += [
            gemv,
            {**gemv, "BLOCK_N": gemv["BLOCK_N"] // 2, "BLOCK_K": gemv["BLOCK_K"] * 2},
            # both K loops pipelined: more weight bytes in flight per program
            {**gemv, "num_stages": 3, "down_num_stages": 2},
        ]
    return out


def _check_config(cfg: dict) -> dict:
    if cfg.get("kernel", "gemm") == "gemv":
        return check_gemv_config(cfg)
    if cfg.get("kernel", "gemm") != "gemm":
        raise ValueError(f"fused_moe config kernel must be 'gemm' or 'gemv', got {cfg['kernel']!r}")
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"fused_moe config lacks {missing}")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{key} must be a power of two >= 16, got {v!r}")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']!r}")
    for key in ("GROUP_M", "num_stages"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {cfg[key]!r}")
    return cfg
