"""The GPU's GEMM rate in bf16 and FP8, the "limit" that prefill throughput is judged
against, and each FP8 GEMM candidate at prefill shapes.

Rows: a square 8192^3 product and the Llama-3 projections (8B and 70B) at 16,384
tokens (8 x 2048 prefill), each timed as the median of `triton.testing.do_bench`
(after warm-up; every kernel compiled first):
- bf16: `torch.mm` (cuBLAS);
- fp8 tensor / rowwise: `torch._scaled_mm` (cuBLASLt) with per-tensor scales (the
  FP8 peak) and row-wise scales, on pre-quantized operands;
- fp8 block (cuBLASLt): `torch._scaled_mm` with 1 x 128 activation and 128 x 128
  weight block scales, where torch and CUDA have it (12.9+);
- fp8 block (triton): pdserve's block-scaled FP8 GEMM (triton/fp8_gemm.py) at its
  default tiles, and with --sweep its best of a few tile configs.
The FP8 rows exclude activation quantization (the engine adds one quantize kernel).

    python benchmarks/gemm_rate.py [--tokens 16384] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch

SQUARE = ("square", 8192, 8192, 8192)
PROJECTIONS = {  # name -> (N, K)
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "70b qkv": (10240, 8192),
    "70b o": (8192, 8192),
    "70b gate_up": (57344, 8192),
    "70b down": (8192, 28672),
}
SWEEP = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
    for (bm, bn), w, s in itertools.product(((128, 128), (128, 256), (256, 128)), (8,), (3, 4))
] + [dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)]


def _bench(fn) -> float:
    from triton.testing import do_bench

    fn()
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds


def _row(name, m, n, k, kernel, seconds, best=""):
    flops = 2 * m * n * k
    print(
        f"| {name} | {m}x{n}x{k} | {kernel} | {seconds * 1e6:.0f} | {flops / seconds / 1e12:.0f} | {best} |",
        flush=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="M of the projection rows")
    p.add_argument("--sweep", action="store_true", help="also the triton GEMM's best tile config")
    p.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    args = p.parse_args(argv)

    dev = torch.device("cuda")
    print(
        f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    print("| shape | M x N x K | kernel | us | TFLOP/s | config |")
    print("|---|---|---|---:|---:|---|")
    shapes = [SQUARE] + [(name, args.tokens, n, k) for name, (n, k) in PROJECTIONS.items()]
    for name, m, n, k in shapes:
        if not args.only or name in args.only:
            _bench_shape(name, m, n, k, args.sweep)
            torch.cuda.empty_cache()


def _bench_shape(name: str, m: int, n: int, k: int, sweep: bool) -> None:
    from services.kernels.fp8 import Fp8Format
    from services.kernels.triton.fp8_gemm import fp8_gemm

    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    block = Fp8Format("block", 128, 128)
    torch.manual_seed(0)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    _row(name, m, n, k, "bf16 torch.mm", _bench(lambda: torch.mm(a, w.t())))
    aq, wq = a.to(fp8), w.to(fp8)
    one = torch.ones((), device=dev)
    _row(name, m, n, k, "fp8 tensor (cuBLASLt)", _bench(
        lambda: torch._scaled_mm(aq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    ))  # fmt: skip
    sa = torch.rand(m, 1, device=dev) + 0.5
    sb = torch.rand(1, n, device=dev) + 0.5
    _row(name, m, n, k, "fp8 rowwise (cuBLASLt)", _bench(
        lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    ))  # fmt: skip
    xs = torch.rand(k // 128, m, device=dev).add_(0.5).t()  # [M, K/128] column-major
    ws = torch.rand(n // 128, k // 128, device=dev).add_(0.5)
    try:
        _row(name, m, n, k, "fp8 block (cuBLASLt)", _bench(
            lambda: torch._scaled_mm(aq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
        ))  # fmt: skip
    except Exception as exc:  # no block scaling in this torch / CUDA
        print(f"| {name} | {m}x{n}x{k} | fp8 block (cuBLASLt) | - | - | {str(exc)[:80]} |")
    xs_rows = xs.contiguous()

    def triton_gemm(cfg=None):
        return lambda: fp8_gemm(aq, xs_rows, wq, ws, block, None, torch.bfloat16, config=cfg)

    _row(name, m, n, k, "fp8 block (triton)", _bench(triton_gemm()), "default")
    if sweep:
        timed = []
        for cfg in SWEEP:
            try:
                timed.append((_bench(triton_gemm(cfg)), cfg))
            except Exception as exc:  # out of shared memory
                print(f"| {name} | | triton {cfg} | failed: {str(exc)[:60]} | | |")
        if timed:
            seconds, cfg = min(timed, key=lambda t: t[0])
            tiles = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
            _row(name, m, n, k, "fp8 block (triton, best)", seconds, tiles)


if __name__ == "__main__":
    main()
