"""Kernel tests run the real kernels: compiled on a GPU, or on the CPU through Triton's
interpreter. TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so
this conftest sets it (CPU only) before the test modules import the backends."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - the worker extras are missing
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if _HAS_CUDA else "cpu"
