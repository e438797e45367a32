"""Launch helpers shared by the Triton kernels: interpreter detection, sizes, and
programmatic dependent launch."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

try:  # Triton >= 3.3: grid dependency control (Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

# "0" turns programmatic dependent launch off (an A/B switch for benchmarks).
PDL_ENV = "PDSERVE_TRITON_PDL"


def env_switch(name: str, default: str, values: tuple[str, ...]) -> str:
    """An A/B environment switch's value, or `default` when unset. Any other value is a
    ValueError naming the variable: a mistyped switch must not run the other branch."""
    value = os.environ.get(name, default)
    if value not in values:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(values)}")
    return value


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on the
    CPU through numpy, and CPU tensors are fine)."""
    return isinstance(kernel, InterpretedFunction) or isinstance(
        getattr(kernel, "fn", None), InterpretedFunction
    )


def check_device(kernel, *tensors: torch.Tensor) -> None:
    if is_interpreted(kernel):
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                "the triton kernel backend needs CUDA/ROCm tensors (got a tensor on "
                f"{t.device}); on a CPU set TRITON_INTERPRET=1 before importing triton, "
                "or use kernel_backend='torch'"
            )


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU; a nominal 8 when interpreting on a CPU."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else 0)
    return 8


@functools.cache
def _smem_optin(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


def device_smem(t: torch.Tensor) -> int | None:
    """The most shared memory one program may use on t's GPU (None: no limit known,
    or interpreting on a CPU)."""
    if t.is_cuda:
        return _smem_optin(t.device.index if t.device.index is not None else 0)
    return None


def rows_per_program(interpreted: bool, n_rows: int, row_elems: int, gpu_rows: int = 1) -> int:
    """Rows handled by one program. On a GPU one (or a few) rows per program keeps
    every SM busy; the interpreter pays per program, so it takes big row blocks."""
    if not interpreted:
        return gpu_rows
    budget = max(1, (1 << 16) // next_pow2(row_elems))
    return min(next_pow2(n_rows), 1 << (budget.bit_length() - 1))


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Launch the kernels that work on t with programmatic dependent launch (PDL): on
    Hopper and later NVIDIA GPUs a kernel may then start while the previous one in the
    stream drains, and waits (`pdl_sync`) only where it first touches that kernel's
    results. At decode batch sizes a layer is a dozen kernels of a few microseconds,
    so the gap between two of them is a large share of the step (docs/performance.md).
    CUDA graphs keep the overlap (captured as programmatic edges)."""
    if not t.is_cuda or gdc_wait is None or env_switch(PDL_ENV, "1", ("0", "1")) == "0":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _pdl_capable(index)


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished and its writes are
    visible, then let the next kernel begin launching. Every kernel launched with PDL
    calls this in every program before it reads anything a kernel wrote or writes
    anything (only weights, which no kernel writes while serving, may be read before),
    so "finished" carries down the chain."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
