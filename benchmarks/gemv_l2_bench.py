"""One-row bf16 GEMV time with its weight in the L2 (one copy) and past it (eight
copies), pdserve's GEMV against F.linear (cuBLAS), at Qwen3-30B-A3B and Llama-3-8B
projection shapes; eight calls per CUDA-graph replay. GPU only.

    PYTHONPATH=$PWD python benchmarks/gemv_l2_bench.py
"""

import torch
import torch.nn.functional as F

from services.kernels.triton.gemv import gemv

p = torch.cuda.get_device_properties(0)
print(p.name, "L2", getattr(p, "L2_cache_size", None) or getattr(p, "l2_cache_size", None))
shapes = {
    "q3 qkv": (5120, 2048),
    "q3 o": (2048, 4096),
    "q3 router": (128, 2048),
    "l8 qkv": (6144, 4096),
    "l8 o": (4096, 4096),
}


for name, (n, k) in shapes.items():
    row = []
    for copies in (1, 8):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for label, fn in (
            ("gemv", lambda w, x=x: gemv(x, w)),
            ("cublas", lambda w, x=x: F.linear(x, w)),
        ):
            for w in ws:
                fn(w)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(8 // copies):
                    for w in ws:
                        fn(w)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(50):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            us = e0.elapsed_time(e1) * 1e3 / 50 / 8
            row.append(f"{label} x{copies} {us:.1f}us ({n * k * 2 / us / 1e6:.2f} TB/s)")
    print(name, " | ".join(row), flush=True)
