"""What a CPU KV block's first write costs: the cache from torch.zeros (every page
written at start) against kv_memory.py's mapping (zeroed pages on first write).

    python benchmarks/kv_first_write.py            # SmolLM2's block: 30 layers, 3 KV heads of 64
"""

from __future__ import annotations

import argparse
import time

import torch

from services.engine.kv_memory import zeroed_kv_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=600)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    block = (args.kv_heads, args.layers, 2, args.block_size, args.head_dim)
    shape = (args.blocks, *block)
    src = torch.randn(block)
    n = args.blocks
    print(f"block {src.numel() * 4 / 1024:.0f} KB of fp32, {n} blocks")
    for _ in range(args.rounds):
        for name in ("torch.zeros", "mapping"):
            t0 = time.perf_counter()
            kv = (
                torch.zeros(shape)
                if name == "torch.zeros"
                else zeroed_kv_tensor(shape, torch.float32, "cpu")
            )
            t1 = time.perf_counter()
            for b in range(n):
                kv[b].copy_(src)
            t2 = time.perf_counter()
            for b in range(n):
                kv[b].copy_(src)
            t3 = time.perf_counter()
            print(
                f"{name:12s} allocation {1e3 * (t1 - t0):7.1f} ms   first write {1e6 * (t2 - t1) / n:6.0f} us"
                f" a block   later writes {1e6 * (t3 - t2) / n:5.0f} us"
            )
            del kv


if __name__ == "__main__":
    main()
