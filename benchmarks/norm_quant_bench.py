"""The quantizing norm (triton/norm_quant.py) against the plain one, and the block-FP8
GEMV reading the row it quantized against the GEMV quantizing the row itself, at
Llama-3-8B's qkv and gated gate_up shapes, one row, CUDA-graph replays (the GEMVs over
weight copies past the L2). GPU only.

    PYTHONPATH=$PWD python benchmarks/norm_quant_bench.py
"""

import functools

import torch

from services.kernels.fp8 import Fp8Format
from services.kernels.timing import copies_past_l2, cycled_graph_us, time_graph_us
from services.kernels.triton import fp8_gemv
from services.kernels.triton.gated_gemv import fp8_gemv_silu_and_mul
from services.kernels.triton.norm import fused_add_rms_norm
from services.kernels.triton.norm_quant import add_rms_norm_quant
from services.kernels.tuner_cases import random_fp8_layer

fmt = Fp8Format("block", 128, 128)
k = 4096
h = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
r = torch.randn_like(h)
nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
plain = time_graph_us(lambda: fused_add_rms_norm(h, r, nw, 1e-5))
quant = time_graph_us(lambda: add_rms_norm_quant(h, r, nw, 1e-5, 128, torch.float8_e4m3fn))
print(torch.cuda.get_device_name(), f"norm {plain:.2f} us, norm+quant {quant:.2f} us")
x, _ = fused_add_rms_norm(h, r, nw, 1e-5)
_, _, xq, xs = add_rms_norm_quant(h, r, nw, 1e-5, 128, torch.float8_e4m3fn)
for name, n, gated in (("qkv", 6144, False), ("gate_up", 28672, True)):
    gen = torch.Generator().manual_seed(0)
    layers = [
        (lay.weight, lay.weight_scale)
        for lay in (random_fp8_layer(k, n, fmt, gen, "cuda") for _ in range(copies_past_l2(n * k)))
    ]
    own = fp8_gemv_silu_and_mul if gated else fp8_gemv.fp8_gemv
    a = cycled_graph_us([functools.partial(own, x, w, s, fmt, None) for w, s in layers])
    given = [
        functools.partial(
            fp8_gemv.run, xq, w, s, fmt, None, None, None, None, gated=gated, x_scales=xs
        )  # fmt: skip
        for w, s in layers
    ]
    b = cycled_graph_us(given)
    print(f"{name}: own quantization {a:.1f} us, the norm's {b:.1f} us", flush=True)
