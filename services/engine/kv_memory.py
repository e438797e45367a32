"""Zeroed memory for the KV cache.

On a GPU, torch.zeros. On a CPU the cache comes from an anonymous memory mapping
instead: the kernel hands out a zeroed page when it is first written, so a worker's
resident memory grows with the blocks it has actually used rather than with
--kv-cache-memory-gb at start (torch.zeros writes every page, 1 GiB by default), and
never-used blocks read as the shared zero page. The zeroing moves from start-up to each
block's first write (docs/performance.md). Since the pages are taken later, a cache
larger than the host's available memory is refused at start (host_memory_check), not
left to an out-of-memory kill mid-request. The tensor keeps the mapping alive."""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

GiB = 1 << 30


def host_available_bytes() -> int | None:
    """MemAvailable, or less where a cgroup (v2) memory limit leaves less; None if
    neither can be read."""
    known = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            known.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(known) if known else None


def host_memory_check(nbytes: int, num_blocks: int) -> None:
    """Refuse a CPU KV cache the host cannot hold, naming the flags that size it."""
    available = host_available_bytes()
    if available is not None and nbytes > available:
        raise ValueError(
            f"the KV cache needs {nbytes / GiB:.1f} GiB ({num_blocks} blocks; "
            f"--num-kv-blocks / --kv-cache-memory-gb) but this host has "
            f"{max(available, 0) / GiB:.1f} GiB available"
        )


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed [num_blocks, ...] KV cache tensor (see the module's docstring)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    nbytes = numel * dtype.itemsize
    host_memory_check(nbytes, shape[0])
    pages = mmap.mmap(-1, nbytes)  # anonymous and private: zero-filled on first touch
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)
