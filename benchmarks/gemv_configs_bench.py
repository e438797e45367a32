"""Time pdserve's bf16 GEMV (triton/gemv.py) over a grid of launch configs, for the
dense projections of a model config, as CUDA-graph replays. Each call reads a
different copy of the weight (together well past the L2 cache), so the bandwidth is
HBM's. Prints the default config's time and the best few, in us and TB/s of weight.

    python benchmarks/gemv_configs_bench.py --config benchmarks/configs/qwen3-30b-a3b.json
        [--rows 1] [--block-n 2 4 8 16] [--block-k 256 512 1024 2048] [--warps 2 4 8]
        [--stages 1 3] [--split-k 1 2 4] [--fold 1 8]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from services.kernels.timing import copies_past_l2, cycled_graph_us


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the projections a decode step runs through the GEMV."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    out = {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d)}
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        out["router"] = (cfg.get("num_experts") or cfg["num_local_experts"], h)
    else:
        out["gate_up"] = (2 * cfg["intermediate_size"], h)
        out["down"] = (h, cfg["intermediate_size"])
    out["lm_head"] = (cfg["vocab_size"], h)
    return out


def _norm_then_gemv(x, residual, norm_weight, w, config):
    import importlib

    gemv = importlib.import_module("services.kernels.triton.gemv")
    norm = importlib.import_module("services.kernels.triton.norm")
    h, _ = norm.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    return gemv.gemv(h, w, config=config)


def main() -> None:
    import importlib

    gemv = importlib.import_module("services.kernels.triton.gemv")
    from services.kernels.triton._launch import device_sms

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-30b-a3b.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="*", default=None, help="projection names to time")
    ap.add_argument("--block-n", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="W tiles in flight")
    ap.add_argument("--fold", type=int, nargs="+", default=[1], help="GemvConfig.k_fold (one row)")
    ap.add_argument("--split-k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--with-norm", action="store_true", help="also time norm + GEMV")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    for name, (n, k) in projections(cfg).items():
        if args.only and name not in args.only:
            continue
        copies = copies_past_l2(2 * n * k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            default = gemv.default_config(n, k, device_sms(x), m)
            grid = [
                gemv.GemvConfig(bn, bkk, w, st, s, min(f, bkk))
                for bn, bk, w, st, s, f in itertools.product(
                    args.block_n, args.block_k, args.warps, args.stages, args.split_k, args.fold
                )
                for bkk in [min(bk, max(16, 1 << (k - 1).bit_length()))]
            ]
            results = []
            for c in [default] + sorted(set(grid) - {default}, key=str):
                calls = [functools.partial(gemv.gemv, x, w, config=c) for w in ws]
                results.append((cycled_graph_us(calls), c))
            for us, c in sorted(results, key=lambda r: r[0])[:4] + [results[0]]:
                tag = " (default)" if c == default else ""
                print(
                    f"{name} {n}x{k} m={m} {c.block_n}x{c.block_k} w{c.num_warps} "
                    f"s{c.num_stages} split{c.split_k} f{c.k_fold}: {us:7.1f} us "
                    f"{2 * n * k / us / 1e6:5.2f} TB/s{tag}",
                    flush=True,
                )
            best = min(r[0] for r in results)
            print(f"{name} m={m} best/default {best / results[0][0]:.3f}", flush=True)
            if args.with_norm:  # what a residual-add + RMSNorm launch before it costs
                r, nw = torch.randn_like(x), torch.rand(k, device="cuda", dtype=x.dtype)
                normed = [functools.partial(_norm_then_gemv, x, r, nw, w, default) for w in ws]
                us = cycled_graph_us(normed)
                print(f"{name} m={m} norm + gemv (default): {us:7.1f} us", flush=True)
        del ws


if __name__ == "__main__":
    main()
