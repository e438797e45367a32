"""Greedy sampling's argmax: torch.argmax against the two-stage Triton kernel
(services/kernels/triton/argmax.py) on [rows, vocab] logits, as CUDA-graph replays
over copies of the logits that together exceed the L2 cache (a decode step's logits
come from HBM, written by the LM head). Checks that both give the same ids first.

    python benchmarks/argmax_bench.py [--rows 1 8 64 256] [--vocab 128256 151936]
        [--dtype bfloat16 float32]
"""

from __future__ import annotations

import argparse

import torch

from services.kernels.timing import copies_past_l2, cycled_graph_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    from services.kernels.triton.argmax import argmax_rows

    print("| rows | vocab | dtype | torch.argmax | two-stage | speed-up |")
    print("|---|---|---|---|---|---|")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for vocab in args.vocab:
            for rows in args.rows:
                nbytes = rows * vocab * dtype.itemsize
                copies = [
                    torch.randn(rows, vocab, device="cuda").to(dtype)
                    for _ in range(copies_past_l2(nbytes))
                ]
                if not torch.equal(argmax_rows(copies[0]), copies[0].argmax(dim=-1)):
                    raise SystemExit(f"ids differ at rows {rows}, vocab {vocab}, {dtype_name}")
                ours = cycled_graph_us([lambda x=x: argmax_rows(x) for x in copies])
                ref = cycled_graph_us([lambda x=x: x.argmax(dim=-1) for x in copies])
                print(
                    f"| {rows} | {vocab} | {dtype_name} | {ref:.1f} us | {ours:.1f} us "
                    f"| {ref / ours:.2f}x |",
                    flush=True,
                )
                del copies


if __name__ == "__main__":
    main()
