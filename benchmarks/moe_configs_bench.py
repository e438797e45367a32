"""Time pdserve's fused MoE at every launch config the kernel tuner would try
(triton/moe.py candidate_configs: tile configs, and GEMV settings for decode
batches), as CUDA-graph replays, for the expert shapes of Qwen3-30B-A3B and
Mixtral-8x7B in bf16. Prints each config's time, the expert bytes it streams per
microsecond, and its error against the fp32 torch reference.

    python benchmarks/moe_configs_bench.py [--tokens 1 4 8] [--fold-block-k 512 1024]
"""

from __future__ import annotations

import argparse
import functools

import torch

SHAPES = {  # name: (experts, top_k, hidden, expert intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def main() -> None:
    from services.kernels.timing import time_graph_us
    from services.kernels.torch_backend import TorchBackend
    from services.kernels.triton.moe import fused_moe
    from services.kernels.triton.moe_config import candidate_configs

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument(
        "--fold-block-k", type=int, nargs="*", default=[],
        help="also each GEMV candidate with this BLOCK_K and k_fold 8 (per value)",
    )  # fmt: skip
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    for name in args.shapes:
        e, k, h, i = SHAPES[name]
        w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * h**-0.5
        w2 = torch.randn(e, h, i, device=dev, dtype=dt) * i**-0.5
        for t in args.tokens:
            x = torch.randn(t, h, device=dev, dtype=dt)
            logits = torch.randn(t, e, device=dev, dtype=dt)
            ref = TorchBackend().fused_moe(
                x.float(), logits.float(), w13.float(), w2.float(), k, True
            )
            touched = (1 - (1 - k / e) ** t) * e * 3 * h * i * 2  # uniform-routing estimate
            configs = candidate_configs(t, e, h, i, k, dt)
            configs += [
                {**c, "BLOCK_K": bk, "k_fold": 8}
                for c in configs
                if c.get("kernel") == "gemv"
                for bk in args.fold_block_k
            ]
            for cfg in configs:
                out = fused_moe(x, logits, w13, w2, k, True, config=cfg)
                err = float((out.float() - ref).norm() / ref.norm())
                call = functools.partial(fused_moe, x, logits, w13, w2, k, True, config=cfg)
                us = time_graph_us(call)
                print(
                    f"{name} T={t} {us:8.1f} us {touched / us / 1e6:6.2f} TB/s err {err:.1e} {cfg}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
