"""Compile pdserve's one-row GEMV kernels for an H100/H200 (sm_90) on a machine without
a GPU and report what decides their bandwidth before any device time is spent: whether
the K loop is pipelined (cp.async copies into shared memory), the shared memory a
program takes, its registers and spills (Triton's own ptxas, `-v`), and the SASS
instructions a thread runs per pass of the K loop (Triton's cuobjdump).

Arguments are specialised as Triton's launcher would for real tensors: pointers and
sizes 16-divisible, unit strides along K constant 1.

    python benchmarks/compile_sm90.py fp8:8,1024,4,1 fp8:8,1024,4,3 gated:8,256,4,3
    (KERNEL:block_n,block_k,num_warps,num_stages[,k_fold]; KERNEL is gemv, fp8, gated or
    down (a MoE's), gemv+norm / fp8+norm (the RMSNorm folded in) or gemv+silu / fp8+silu
    (a dense gate_up with its SiLU, gated_gemv.py), fp8q / fp8q+silu (x quantized by
    the norm before, norm_quant.py); k_fold for all but down)

Prints one JSON line per kernel. Run it without TRITON_INTERPRET (the interpreter's
kernels cannot be compiled).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TARGET = GPUTarget("cuda", 90, 32)
_SIZES = ("N", "M", "T")  # sizes a launch may pass unaligned


def _ptxas() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_report(fn, pointers: dict[str, str], constexprs: dict, num_warps: int) -> dict:
    """Compile `fn` (a triton.jit kernel; every argument not in `pointers` or
    `constexprs` is an i32) and report cp_async (copies in the PTX), smem (bytes),
    regs and spill_bytes (from ptxas)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "i32")
        if name in pointers or name not in _SIZES:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=_TARGET, options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [_ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v did not report registers and spills:\n{log}")
    return {
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "smem": compiled.metadata.shared,
        "regs": int(regs.group(1)),
        "spill_bytes": int(spills.group(1)),
        "loop_instructions": _longest_loop(compiled.asm["cubin"]),
    }


def _longest_loop(cubin: bytes) -> int:
    """SASS instructions a thread runs per pass of the kernel's longest loop (the K
    loop, for a GEMV): the span of its longest backward branch (Triton's cuobjdump)."""
    tool = os.path.join(os.path.dirname(_ptxas()), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True)
    addrs, longest = [], 0
    for line in sass.stdout.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        addrs.append(addr)
        target = re.search(r"BRA\s+(?:!?P\d,\s*)?0x([0-9a-f]+)", m.group(2))
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            longest = max(longest, sum(1 for a in addrs if start <= a <= addr))
    return longest


_NORM_PTRS = dict(res_ptr="*bf16", nw_ptr="*bf16", res_out_ptr="*bf16", x_out_ptr="*bf16",
                  eps="fp32")  # fmt: skip


def _gemv(block_n, block_k, warps, stages, fold=1, norm=False, silu=False):
    mod = importlib.import_module("services.kernels.triton.gemv")
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", **_NORM_PTRS)
    ce = dict(HAS_NORM=norm, GATED=silu, stride_xk=1, HAS_BIAS=False, EVEN_K=True, BLOCK_M=1, BLOCK_N=block_n,
              BLOCK_K=block_k, SPLIT_K=1, PRECISION="ieee", UPCAST_DOT=False,
              NUM_STAGES=stages, USE_PDL=True, FOLD=fold)  # fmt: skip
    return compile_report(mod._gemv_kernel, ptrs, ce, warps)


def _fp8(block_n, block_k, warps, stages, fold=1, norm=False, silu=False, prequant=False):
    from services.kernels.triton import fp8_gemv

    ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16",
                out_ptr="*bf16", xs_ptr="*fp32", **_NORM_PTRS)  # fmt: skip
    ce = dict(HAS_NORM=norm, GATED=silu, GRANULARITY=0, GROUP=128, SCALE_N=128, HAS_BIAS=False, EVEN_K=True,
              FP8_MAX_=448.0, MIN_AMAX=1e-12, ROUND_IN_FP32=False, BLOCK_N=block_n,
              BLOCK_K=block_k, NUM_STAGES=stages, USE_PDL=True, FOLD=fold,
              PREQUANT=prequant)  # fmt: skip
    return compile_report(fp8_gemv._fp8_gemv_kernel, ptrs, ce, warps)


def _gated(block_n, block_k, warps, stages, fold=1):
    from services.kernels.triton import moe_gemv

    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", act_ptr="*bf16", ids_ptr="*i32")
    ce = dict(stride_xh=1, stride_wk=1, TOP_K=8, BLOCK_N=block_n, BLOCK_K=block_k,
              NUM_STAGES=stages, USE_PDL=True, FOLD=fold)  # fmt: skip
    return compile_report(moe_gemv._gated_kernel, ptrs, ce, warps)


def _down(block_n, block_k, warps, stages):
    from services.kernels.triton import moe_gemv

    ptrs = dict(act_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i32",
                weights_ptr="*bf16")  # fmt: skip
    ce = dict(stride_wk=1, stride_oh=1, TOP_K=8, K_P=8, BLOCK_N=block_n, BLOCK_K=block_k,
              NUM_STAGES=stages, USE_PDL=True)  # fmt: skip
    return compile_report(moe_gemv._down_sum_kernel, ptrs, ce, warps)


KERNELS = {
    "gemv": _gemv,
    "fp8": _fp8,
    "gemv+norm": lambda *a: _gemv(*a, norm=True) if len(a) == 5 else _gemv(*a, 1, True),
    "fp8+norm": lambda *a: _fp8(*a, norm=True) if len(a) == 5 else _fp8(*a, 1, True),
    "gemv+silu": lambda *a: _gemv(*a, silu=True) if len(a) == 5 else _gemv(*a, 1, silu=True),
    "fp8+silu": lambda *a: _fp8(*a, silu=True) if len(a) == 5 else _fp8(*a, 1, silu=True),
    # x quantized by the norm before it (norm_quant.py)
    "fp8q": lambda *a: _fp8(*a, prequant=True) if len(a) == 5 else _fp8(*a, 1, prequant=True),
    "fp8q+silu": lambda *a: (
        _fp8(*a, silu=True, prequant=True) if len(a) == 5 else _fp8(*a, 1, silu=True, prequant=True)
    ),
    "gated": _gated,
    "down": _down,
}


def main() -> None:
    specs = sys.argv[1:]
    if not specs or any(spec.split(":")[0] not in KERNELS for spec in specs):
        sys.exit(__doc__)
    for spec in specs:
        kind, sizes = spec.split(":")
        report = KERNELS[kind](*map(int, sizes.split(",")))
        print(json.dumps({"kernel": spec, **report}), flush=True)


if __name__ == "__main__":
    main()
