"""Launch helpers shared by the Triton kernels: interpreter detection and sizes."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


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
