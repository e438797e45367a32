"""The kernel tuner's FP8 prequant pick (decode1): whether the RMSNorm before a one-row
FP8 GEMV quantizes the row for it (norm_quant.py) or every GEMV program quantizes its
own copy (fp8_gemv.py). Both give the same numbers; which is faster depends on the GPU:
an H100 ran them within 1% (its HBM leaves the GEMV's loop room to issue), while an
H200's FP8 loop is near its issue limit, where the GEMV's fewer instructions may pay.

Timed as the engine runs them, through the triton backend's add_rms_norm_linear: the
norm and the qkv GEMV, then (dense models) the norm and the gated gate_up GEMV, over
weight copies past the L2, per mode. A mode other than "0" is kept only when it wins
by MIN_GAIN; within that the timings are noise and the default stays."""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable

import torch

from services.kernels.shape_classes import KernelShapes
from services.kernels.timing import PAST_L2_BYTES, cycled_graph_us
from services.kernels.tuner_cases import random_fp8_layer, rel_err

log = logging.getLogger(__name__)

# the order they are timed in; "0" (the GEMV quantizes) is the default
PREQUANT_MODES = ("0", "gated", "1")
MIN_GAIN = 0.01
# weight copies timed at most: a small model's layers stay in the L2 (as in its steps)
MAX_COPIES = 64


def prequant_applies(choices: dict[str, str], backend) -> bool:
    """Whether the tuned backend's decode1 norms and FP8 linears would reach the triton
    backend's prequant path with these choices, and its mode is the tuner's to pick
    (not set by PDSERVE_TRITON_FP8_PREQUANT or an argument)."""
    keys = ("fp8_linear.decode1", "fused_add_rms_norm.decode1")
    return all(choices.get(k) == "triton" for k in keys) and backend.fp8_prequant is None


def prequant_times(
    shapes: KernelShapes,
    device,
    backend,
    config: dict | None,
    gated: bool,
    timer: Callable[[list[Callable[[], object]]], float],
    tol: float,
    copies: int | None = None,
) -> dict[str, float]:
    """Microseconds of norm + qkv GEMV (+ norm + gated gate_up GEMV) per mode that
    matches mode "0"'s output within tol; timer(calls) times calls run in turn, one per
    weight copy (copies; None: enough to read from HBM, not the L2, up to MAX_COPIES).
    A mode that fails or strays is left out (logged)."""
    gen = torch.Generator().manual_seed(zlib.crc32(b"fp8_prequant"))
    dtype, fmt, h = shapes.torch_dtype, shapes.fp8_format(), shapes.hidden_size
    (_, qkv_out), _, (_, gate_up_out), _ = shapes.linear_shapes()  # (in, out) each

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, residual, norm_weight = rand(1, h), rand(1, h), rand(h)
    outs = (qkv_out, gate_up_out) if gated else (qkv_out,)
    pair_bytes = h * sum(outs)  # FP8: a byte a weight
    if copies is None:
        copies = min(MAX_COPIES, max(1, -(-(PAST_L2_BYTES // 2) // pair_bytes)))
    layers = [[random_fp8_layer(h, n, fmt, gen, device) for n in outs] for _ in range(copies)]
    eps = shapes.rms_norm_eps

    def case(mode: str, pair):
        cfg = {**(config or {}), "prequant": mode}

        def call():
            out = backend.add_rms_norm_linear(x, residual, norm_weight, eps, pair[0], config=cfg)
            if gated:
                args = (x, residual, norm_weight, eps, pair[1])
                out += backend.add_rms_norm_linear(*args, gated=True, config=cfg)
            return out

        return call

    times, reference = {}, None
    for mode in PREQUANT_MODES:
        try:
            out = case(mode, layers[0])()
            if reference is None:
                reference = out
            err = rel_err(out, reference)
            if not err <= tol:
                log.info("kernel tuner fp8 prequant %s: relative error %.3g > %g", mode, err, tol)
                continue
            times[mode] = timer([case(mode, pair) for pair in layers])
        except Exception as exc:  # a kernel that cannot run these shapes here
            log.info("kernel tuner fp8 prequant %s: %s: %s", mode, type(exc).__name__, exc)
    return times


def pick_prequant(times: dict[str, float]) -> str:
    """The fastest mode where it beats "0" by MIN_GAIN, else "0"."""
    if "0" not in times:  # nothing to beat: keep the default path
        return "0"
    best = min(times, key=times.get)
    return best if times[best] < times["0"] * (1 - MIN_GAIN) else "0"


def tune_prequant(
    choices: dict[str, str], config: dict | None, shapes: KernelShapes, device, tol: float, triton
) -> tuple[dict, dict[str, float]] | None:
    """On a GPU where the decode1 norms and FP8 linears run on triton: fp8_linear.decode1's
    config with the prequant mode picked, and each mode's time; None where it does not
    apply (then the triton backend's own mode holds)."""
    if triton is None or not prequant_applies(choices, triton):
        return None
    gated = not shapes.num_experts and choices.get("silu_and_mul.decode1") == "triton"
    timer = functools.partial(cycled_graph_us, replays=5)
    times = prequant_times(shapes, device, triton, config, gated, timer, tol)
    mode = pick_prequant(times)
    log.info("kernel tuner fp8 prequant: %s %s", mode, times)
    return {**(config or {}), "prequant": mode}, times
