"""Time pdserve's fused FP8 GEMV (triton/fp8_gemv.py) at one decode row over a grid of
launch configs, beside the FP8 GEMM path (quantize + tiled GEMM) and the bf16 GEMV on
the same shape, as CUDA-graph replays. Each call reads a different copy of the weight
(together well past the L2 cache), so the bandwidth is HBM's. Prints time and weight
bytes per second; the default config is marked.

    python benchmarks/fp8_gemv_bench.py [--shapes 8b 70b] [--formats block channel]
        [--block-n 2 4 8 16] [--block-k 512 1024 2048] [--warps 2 4] [--stages 1 3]
        [--fold 1 4 16]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from services.kernels.timing import copies_past_l2, cycled_graph_us

SHAPES = {  # Llama-3 projections: name -> (N, K)
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {
        "qkv": (10240, 8192),
        "o": (8192, 8192),
        "gate_up": (57344, 8192),
        "down": (8192, 28672),
    },
}


class _Layer:
    def __init__(self, weight, scale, fmt):
        self.weight, self.weight_scale, self.fp8_format, self.bias = weight, scale, fmt, None


def _gemm(fmt, layer, rows, config=None):
    from services.kernels.triton import fp8_gemm

    k = rows.shape[1]
    xq, xs = fp8_gemm.quantize_activation(rows, fmt.act_group(k), layer.weight.dtype)
    return fp8_gemm.fp8_gemm(
        xq, xs, layer.weight, layer.weight_scale, fmt, None, rows.dtype, config=config
    )


def _gemm_configs(m: int) -> list[dict]:
    """Tiles around fp8_gemm's defaults for a few rows: narrower N tiles (more
    programs) and deeper pipelines."""
    bm = 16 if m <= 16 else 64
    out = []
    for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (3, 4, 5)):
        out.append(
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=warps, num_stages=stages)
        )
    return out


def _gemv(fmt, cfg, layer, x):
    from services.kernels.triton import fp8_gemv

    return fp8_gemv.fp8_gemv(x, layer.weight, layer.weight_scale, fmt, None, config=cfg)


def _bench_format(label, n, k, fmt, args) -> None:
    from services.kernels.triton import fp8_gemv
    from services.kernels.triton._launch import device_sms

    dev = "cuda"
    layers = []
    for _ in range(copies_past_l2(n * k)):
        w = (torch.rand(n, k, device=dev) * 2 - 1).mul(400).to(torch.float8_e4m3fn)
        s = torch.rand(fmt.scale_shape(n, k), device=dev) * 1e-4 + 1e-4
        layers.append(_Layer(w, s, fmt))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    us = cycled_graph_us([functools.partial(_gemm, fmt, lay, x) for lay in layers])
    print(f"{label} fp8 gemm m=1: {us:7.1f} us {n * k / us / 1e6:5.2f} TB/s", flush=True)
    for m in args.gemm_rows:
        rows = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        timed = [
            (cycled_graph_us([functools.partial(_gemm, fmt, lay, rows) for lay in layers]), None)
        ]
        for cfg in _gemm_configs(m):
            calls = [functools.partial(_gemm, fmt, lay, rows, cfg) for lay in layers]
            timed.append((cycled_graph_us(calls), cfg))
        best = min(timed, key=lambda r: r[0])
        print(
            f"{label} fp8 gemm m={m}: default {timed[0][0]:7.1f} us, best {best[0]:7.1f} us "
            f"{n * k / best[0] / 1e6:5.2f} TB/s {best[1]}",
            flush=True,
        )
    default = fp8_gemv.default_config(n, k, fmt, device_sms(x))
    grid = [
        fp8_gemv.Fp8GemvConfig(bn, bk, w, st, f)
        for bn, bk, w, st, f in itertools.product(
            args.block_n, args.block_k, args.warps, args.stages, args.fold
        )
        if f <= bk
    ]
    results = []
    for cfg in [default] + [c for c in grid if c != default]:
        calls = [functools.partial(_gemv, fmt, cfg, lay, x) for lay in layers]
        results.append((cycled_graph_us(calls), cfg))
    for us, cfg in sorted(results, key=lambda r: r[0])[:4] + [results[0]]:
        tag = " (default)" if cfg == default else ""
        print(
            f"{label} fp8 gemv {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
            f"f{cfg.k_fold}: "
            f"{us:7.1f} us {n * k / us / 1e6:5.2f} TB/s{tag}",
            flush=True,
        )
    best = min(r[0] for r in results)
    print(f"{label} best/default {best / results[0][0]:.3f}", flush=True)


def main() -> None:
    from services.kernels.fp8 import Fp8Format
    from services.kernels.triton import gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["8b"])
    ap.add_argument("--formats", nargs="+", choices=("block", "channel"), default=["block"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--block-k", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="W tiles in flight")
    ap.add_argument("--fold", type=int, nargs="+", default=[1], help="Fp8GemvConfig.k_fold")
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[8, 64])
    args = ap.parse_args()
    fmts = {"block": Fp8Format("block", 128, 128), "channel": Fp8Format("channel")}
    for model in args.shapes:
        for proj, (n, k) in SHAPES[model].items():
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            wb = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(copies_past_l2(2 * n * k))
            ]
            us = cycled_graph_us([functools.partial(gemv, x, w) for w in wb])
            print(
                f"{model} {proj} {n}x{k} bf16 gemv: {us:7.1f} us {2 * n * k / us / 1e6:5.2f} TB/s"
            )
            del wb
            for fname in args.formats:
                _bench_format(f"{model} {proj} {fname}", n, k, fmts[fname], args)


if __name__ == "__main__":
    main()
