"""Kernel tests run the real kernels: compiled on a GPU, or on the CPU through Triton's
interpreter. TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so
this conftest sets it (CPU only) before the test modules import the backends."""

from __future__ import annotations

import os
import sys

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - the worker extras are missing
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "services.kernels.triton" in sys.modules:
        # A module collected earlier imported the kernels: they were compiled for a
        # GPU and every kernel test would fail on the CPU. Say so once, up front.
        raise pytest.UsageError(
            "services.kernels.triton was imported before tests/kernels/conftest.py set "
            "TRITON_INTERPRET=1; import the Triton kernels inside the test that needs them"
        )


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture
def quant_calls(monkeypatch):
    """How many norms quantized the row for the FP8 GEMV after them, by plain and gated
    (norm_quant.py's real kernels, counted)."""
    from services.kernels.triton import norm_quant

    calls = {"plain": 0, "gated": 0}
    fn = norm_quant.add_rms_norm_quant_fp8_gemv

    def counted(*args, **kwargs):
        calls["gated" if kwargs.get("gated") else "plain"] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(norm_quant, "add_rms_norm_quant_fp8_gemv", counted)
    return calls
