"""The kernel tuner's candidate backends by name: which ones a device measures, and each
built if it can be here (tuner.py times them)."""

from __future__ import annotations

import logging

import torch

from services.kernels.cpu_backend import CpuOneDnnBackend, CpuSlabBackend
from services.kernels.sdpa_backend import SdpaBackend
from services.kernels.torch_backend import TorchBackend

log = logging.getLogger(__name__)

GPU_CANDIDATES = ("torch", "triton", "aiter", "sdpa", "scaled_mm")
# Triton's kernels run on a CPU only under its interpreter (tests), where time means
# nothing: a CPU measures its own candidates, which differ in linear only (SDPA's
# attention lost to the reference at every class on the 2-core EPYC, and measuring
# attention there took seconds of start-up); a first start measures for 2-3 s on
# SmolLM2, most of it the decode linears over all 30 layers' weights (tuner_cases.py).
CPU_CANDIDATES = ("torch", "cpu_slab", "cpu_onednn", "cpu_native")


def default_candidates(device: torch.device | str) -> tuple[str, ...]:
    return GPU_CANDIDATES if torch.device(device).type == "cuda" else CPU_CANDIDATES


def load_candidates(names=GPU_CANDIDATES) -> dict[str, object]:
    """Every candidate backend that constructs here (others are skipped, logged)."""
    out: dict[str, object] = {}
    for name in names:
        try:
            if name == "torch":
                out[name] = TorchBackend()
            elif name == "sdpa":
                out[name] = SdpaBackend()
            elif name == "cpu_slab":
                out[name] = CpuSlabBackend()
            elif name == "cpu_onednn":
                out[name] = CpuOneDnnBackend()
            elif name == "cpu_native":
                # lazy: builds its C kernels on the first start (needs a C compiler)
                from services.kernels.cpu_native import CpuNativeBackend

                out[name] = CpuNativeBackend()
            elif name == "scaled_mm":
                # lazy: an FP8-only candidate that refuses to build off NVIDIA sm_89+
                from services.kernels.scaled_mm_backend import ScaledMMBackend

                out[name] = ScaledMMBackend()
            elif name == "triton":
                # lazy: triton is an optional, heavy import (absent on CPU-only installs)
                from services.kernels.triton_backend import TritonBackend

                out[name] = TritonBackend()
            elif name == "aiter":
                # lazy: aiter (or its shims over triton) is optional and heavy
                from services.kernels.aiter_backend import AiterBackend

                out[name] = AiterBackend(use_triton_gemm=True)
            else:
                raise ValueError(f"unknown kernel candidate {name!r}")
        except Exception as exc:  # missing package, ROCm-only import, ...
            log.info("kernel candidate %s unavailable: %s", name, exc)
    return out
