"""How fast each one-row GEMV can go when HBM is not what limits it: the same kernel
timed over weight copies past the L2 (the HBM rate, as in a decode step) and over one
copy that stays in the L2. On an H100 the L2 serves well above the H200's 4.8 TB/s HBM,
and both cards have the same SMs, so a kernel whose L2-resident rate stays near the
H200's HBM rate is bound by its own issue and latency there: the FP8 GEMV's question
(issue 14), measurable on an H100.

Llama-3-8B's projections, each cut to the rows that fit `--resident-mb` (the kernel's
tile per program does not change; the grid shrinks): the bf16 GEMV, the block-FP8 GEMV
quantizing its row, and the same GEMV reading a row the norm quantized (PREQUANT,
norm_quant.py), plain and gated (gate_up). CUDA-graph replays; GPU only.

    PYTHONPATH=$PWD python benchmarks/gemv_headroom.py [--resident-mb 20]
"""

from __future__ import annotations

import argparse
import functools

import torch

from services.kernels.fp8 import Fp8Format
from services.kernels.timing import copies_past_l2, cycled_graph_us
from services.kernels.triton import fp8_gemv
from services.kernels.triton.gated_gemv import fp8_gemv_silu_and_mul, gemv_silu_and_mul
from services.kernels.triton.gemv import gemv
from services.kernels.triton.norm_quant import add_rms_norm_quant
from services.kernels.tuner_cases import random_fp8_layer

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FMT = Fp8Format("block", 128, 128)


def _kernels(k: int, gated: bool):
    """name -> (bytes a weight element, weight maker for n rows, call(weight, x, xq, xs))."""
    gen = torch.Generator().manual_seed(0)

    def bf16_weight(n):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

    def fp8_weight(n):
        return random_fp8_layer(k, n, FMT, gen, "cuda")

    def bf16(w, x, xq, xs):
        return (gemv_silu_and_mul if gated else gemv)(x, w)

    def fp8(w, x, xq, xs):
        own = fp8_gemv_silu_and_mul if gated else fp8_gemv.fp8_gemv
        return own(x, w.weight, w.weight_scale, FMT, None)

    def fp8_prequant(w, x, xq, xs):
        args = (w.weight, w.weight_scale, FMT, None, None, None, None)
        return fp8_gemv.run(xq, *args, gated=gated, x_scales=xs)

    return {
        "bf16": (2, bf16_weight, bf16),
        "fp8": (1, fp8_weight, fp8),
        "fp8 prequant": (1, fp8_weight, fp8_prequant),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resident-mb", type=float, default=20.0, help="weight bytes kept in L2")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for proj in args.shapes:
        n, k = SHAPES[proj]
        gated = proj == "gate_up"
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r, nw = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
        _, _, xq, xs = add_rms_norm_quant(x, r, nw, 1e-5, FMT.block_k, torch.float8_e4m3fn)
        for name, (elem, make, call) in _kernels(k, gated).items():
            rows = min(n, int(args.resident_mb * 2**20) // (elem * k) // 256 * 256)
            hbm = [make(rows) for _ in range(copies_past_l2(elem * rows * k))]
            rates = []
            for weights in (hbm, hbm[:1] * 16):  # one copy, 16 calls a graph
                us = cycled_graph_us([functools.partial(call, w, x, xq, xs) for w in weights])
                rates.append((us, elem * rows * k / us / 1e6))
            (hu, hr), (lu, lr) = rates
            print(
                f"{proj} {rows}x{k} {name:12s}: HBM {hu:6.1f} us {hr:5.2f} TB/s | "
                f"L2-resident {lu:6.1f} us {lr:5.2f} TB/s",
                flush=True,
            )
            del hbm


if __name__ == "__main__":
    main()
