"""Kernel backends behind one interface.

Models call `ops.<name>(...)` on a backend object and never import a backend module
directly, so `triton` and `aiter` backends plug in without touching the models.
"""

from __future__ import annotations

from services.kernels.interface import AttentionMetadata, KernelBackend

_BACKENDS = ("torch",)


def get_backend(name: str = "torch") -> KernelBackend:
    if name == "torch":
        from services.kernels.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(_BACKENDS)}")


__all__ = ["AttentionMetadata", "KernelBackend", "get_backend"]
