"""Kernel backends behind one interface.

Models call `ops.<name>(...)` on a backend object and never import a backend module
directly, so `triton` and `aiter` backends plug in without touching the models.

- torch:  plain torch, the reference (CPU and GPU).
- triton: pdserve's own Triton kernels (services/kernels/triton/); NVIDIA and AMD GPUs,
          or a CPU under TRITON_INTERPRET=1 (tests only: slow).
- aiter:  AMD AITER's Triton kernels (native `import aiter` on ROCm, shimmed
          `aiter.ops.triton.*` elsewhere) with the triton backend for the ops it lacks.
- tuned:  per operation and shape class, whichever of those (and torch's fused SDPA
          for prefill attention) measured fastest on this GPU (tuned_backend.py; the
          classes are in shape_classes.py, the measuring in tuner.py).
"""

from __future__ import annotations

from services.kernels.interface import AttentionMetadata, KernelBackend
from services.kernels.torch_backend import TorchBackend

_BACKENDS = ("torch", "triton", "aiter", "tuned")


def get_backend(name: str = "torch", *, shapes=None, device=None, choices=None) -> KernelBackend:
    """`tuned` also needs the model's KernelShapes and the device it runs on; `choices`
    ("op[.class]=candidate,...") overrides what the tuner picked."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        try:  # lazy: triton is optional and heavy; CPU start-up never imports it
            from services.kernels.triton_backend import TritonBackend
        except ImportError as exc:
            raise ValueError(
                f"kernel backend 'triton' needs the triton package ({exc}); "
                "pip install triton, or use kernel_backend='torch'"
            ) from exc
        return TritonBackend()
    if name == "aiter":
        try:  # lazy: aiter (or triton, under its shims) is optional and heavy
            from services.kernels.aiter_backend import AiterBackend

            return AiterBackend()
        except ImportError as exc:  # includes aiter_shims.AiterUnavailable
            raise ValueError(
                f"kernel backend 'aiter' is unavailable here: {exc}; "
                "use 'triton' or 'torch' instead"
            ) from exc
    if name == "tuned":
        if shapes is None or device is None:
            raise ValueError("kernel backend 'tuned' needs the model shapes and a device")
        # lazy: the measuring code (and triton, through its candidates) only when tuned
        from services.kernels.tuned_backend import build_tuned_backend

        return build_tuned_backend(shapes, device, choices)
    raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(_BACKENDS)}")


__all__ = ["AttentionMetadata", "KernelBackend", "get_backend"]
