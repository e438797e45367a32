"""Where pdserve keeps files between runs, from the environment: the cache root (the
converted default model lives under it) and the kernel tuner's folder. A module of its
own, importing nothing of pdserve, so that the kernels and the models both read it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve (~/.cache/pdserve)."""
    root = os.environ.get("PDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


def kernel_tuning_dir() -> Path:
    """PDSERVE_KERNEL_TUNING_DIR, else the cache root's kernel_tuning/ (a container
    whose model cache is read-only points it elsewhere)."""
    env = os.environ.get("PDSERVE_KERNEL_TUNING_DIR")
    return Path(env) if env else cache_root() / "kernel_tuning"
