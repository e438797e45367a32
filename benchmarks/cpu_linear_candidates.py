"""One-row linears on this CPU, per candidate, at a model's decode shapes: the cost
behind a one-request decode step (issue 21). Each shape is timed over one copy of the
weight per layer, as a step streams them (the weights do not stay in cache), best of
--repeats; GB/s is the weight's bytes over that time.

    .venv/bin/python benchmarks/cpu_linear_candidates.py [--dtype bfloat16] [--threads 2]

Candidates: F.linear; oneDNN's linear on a prepacked weight (the tuned backend's
cpu_onednn); torch.mv; the column-slab bmm (cpu_slab). Shapes: SmolLM2-135M's
(qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536, 30 layers; LM head 49152x576)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def candidates():
    from services.kernels.cpu_backend import column_slabs

    return {
        "F.linear": (lambda w: w, lambda x, w: F.linear(x, w)),
        "onednn": (
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        ),
        "mv": (lambda w: w, lambda x, w: torch.mv(w, x[0])),
        "slab": (column_slabs, lambda x, s: torch.bmm(x.expand(s.shape[0], -1, -1), s)),
    }


def best_time(fn, weights, x, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = {s: [torch.randn(*s).to(dtype) for _ in range(args.layers)] for s in SHAPES}
    weights[HEAD] = [torch.randn(*HEAD).to(dtype)]
    size = torch.finfo(dtype).bits // 8
    print(f"{args.dtype}, {args.threads} threads; us per call (GB/s)")
    print("| candidate | " + " | ".join(f"{n}x{k}" for n, k in [*SHAPES, HEAD]) + " | one step |")
    print("|---|" + "---:|" * (len(SHAPES) + 2))
    for name, (prepare, fn) in candidates().items():
        cells, step = [], 0.0
        for shape in [*SHAPES, HEAD]:
            prepared = [prepare(w) for w in weights[shape]]
            x = torch.randn(1, shape[1]).to(dtype)
            t = best_time(fn, prepared, x, args.repeats)
            cells.append(f"{t * 1e6:.0f} ({shape[0] * shape[1] * size / t / 1e9:.1f})")
            step += t * (1 if shape == HEAD else args.layers)
        print(f"| {name} | " + " | ".join(cells) + f" | {step * 1e3:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
