"""Loading AITER's pure-Triton kernels (`aiter.ops.triton.*`) outside ROCm.

On ROCm `import aiter` works and is used as is. Elsewhere (NVIDIA, or a CPU under
TRITON_INTERPRET=1) the package's ROCm-only `aiter/__init__.py` cannot run, but its
Triton kernels can, once three things are shimmed (measured on an H200 with
amd-aiter 0.1.7.post2.dev18; docs/architecture.md, Kernels):

1. bare package modules: `aiter`, `aiter.ops`, `aiter.ops.triton` are registered in
   sys.modules as empty packages whose __path__ points into the installed package, so
   `import aiter.ops.triton.<op>` finds the submodules without running the inits;
2. `arch_info.get_arch()` returns a string (on NVIDIA it gets Triton's int, e.g. 90,
   and code does `arch in ("gfx950")`); the default answer "gfx942" lets the kernels
   that look up tuning tables by arch borrow the MI300X ones (they run, untuned for
   Hopper); PDSERVE_AITER_ARCH overrides it;
3. launch options that only AMD's Triton knows (waves_per_eu, matrix_instr_nonkdim,
   kpack) are dropped before launch: every Triton kernel object in the loaded aiter
   modules gets a per-instance `run` that filters them out.

Also, only when no GPU is visible (interpreter tests): device_info.get_num_sms(),
which asks torch.cuda, answers a nominal count.

Nothing here touches Triton globally: only aiter's own modules and kernel objects are
patched. The shims are checked against AITER_CHECKED_VERSION; another installed
version logs a warning (the internals patched here are not a stable API)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
import warnings

log = logging.getLogger(__name__)

AITER_DIST = "amd-aiter"
AITER_CHECKED_VERSION = "0.1.7.post2.dev18"
AMD_ONLY_LAUNCH_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
DEFAULT_ARCH = "gfx942"
CPU_NUM_SMS = 8

_SHIMMED_FLAG = "_pdserve_shimmed"


class AiterUnavailable(ImportError):
    """amd-aiter is missing or its Triton kernels cannot be loaded here."""


def _not_installed() -> AiterUnavailable:
    return AiterUnavailable(f"{AITER_DIST} is not installed (pip install {AITER_DIST})")


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(AITER_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> bool:
    """Warn (once per call site) when the installed amd-aiter is not the checked one.
    Raises AiterUnavailable when it is not installed (nor already imported)."""
    version = installed_version() if version is None else version
    if version is None:
        if "aiter" not in sys.modules:
            raise _not_installed()
        warnings.warn(
            f"aiter is imported but {AITER_DIST}'s version is unknown (no package metadata); "
            f"pdserve's aiter shims were checked with {AITER_CHECKED_VERSION} and patch its "
            "internals: verify the aiter backend (tests/kernels) before trusting it",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    if version != AITER_CHECKED_VERSION:
        warnings.warn(
            f"{AITER_DIST} {version} is installed; pdserve's aiter shims were checked with "
            f"{AITER_CHECKED_VERSION} and patch its internals: verify the aiter backend "
            "(tests/kernels) before trusting it",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def is_rocm() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def arch_string() -> str:
    return os.environ.get("PDSERVE_AITER_ARCH", DEFAULT_ARCH)


def _package_dir() -> str:
    spec = importlib.util.find_spec("aiter") if "aiter" not in sys.modules else None
    if spec is None:
        mod = sys.modules.get("aiter")
        paths = list(getattr(mod, "__path__", []) or [])
    else:
        paths = list(spec.submodule_search_locations or [])
    if not paths:
        raise _not_installed()
    return paths[0]


def register_bare_packages() -> None:
    """Shim 1: empty `aiter`, `aiter.ops`, `aiter.ops.triton` package modules."""
    if getattr(sys.modules.get("aiter"), _SHIMMED_FLAG, False):
        return
    if "aiter" in sys.modules:
        # A real `import aiter` already ran (ROCm): nothing to shim.
        return
    root = _package_dir()
    for name, sub in (("aiter", ""), ("aiter.ops", "ops"), ("aiter.ops.triton", "ops/triton")):
        path = os.path.join(root, sub) if sub else root
        if not os.path.isdir(path):
            raise AiterUnavailable(f"{path} is missing: not an amd-aiter with Triton kernels")
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        mod.__package__ = name
        mod.__file__ = os.path.join(path, "__init__.py")
        mod.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        mod.__spec__.submodule_search_locations = [path]
        setattr(mod, _SHIMMED_FLAG, True)
        sys.modules[name] = mod
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, mod)


def patch_arch_info() -> None:
    """Shim 2: get_arch() answers a string."""
    arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    if getattr(arch_info.get_arch, _SHIMMED_FLAG, False):
        return

    def get_arch() -> str:
        return arch_string()

    setattr(get_arch, _SHIMMED_FLAG, True)
    arch_info.get_arch = get_arch


def patch_num_sms() -> None:
    """CPU only: get_num_sms() without a GPU (for interpreter tests)."""
    import torch

    device_info = importlib.import_module("aiter.ops.triton.utils.device_info")
    original = device_info.get_num_sms
    if getattr(original, _SHIMMED_FLAG, False):
        return

    def get_num_sms() -> int:
        return original() if torch.cuda.is_available() else CPU_NUM_SMS

    setattr(get_num_sms, _SHIMMED_FLAG, True)
    device_info.get_num_sms = get_num_sms


def drop_amd_launch_options(kernel) -> None:
    """Shim 3 for one kernel object (JITFunction, Autotuner, Heuristics, or the
    interpreter's function): an instance-level `run` that filters AMD-only kwargs.
    `kernel[grid](...)` calls `self.run`, so the instance attribute wins; wrappers
    (Autotuner.fn, Heuristics.fn) are patched down the chain."""
    seen = set()
    while kernel is not None and id(kernel) not in seen:
        seen.add(id(kernel))
        run = getattr(kernel, "run", None)
        if callable(run) and not getattr(run, _SHIMMED_FLAG, False):

            def filtered(*args, _run=run, **kwargs):
                for key in AMD_ONLY_LAUNCH_OPTIONS:
                    kwargs.pop(key, None)
                return _run(*args, **kwargs)

            setattr(filtered, _SHIMMED_FLAG, True)
            try:
                kernel.run = filtered
            except AttributeError:  # pragma: no cover - slotted objects
                log.debug("could not patch %r", kernel)
        kernel = getattr(kernel, "fn", None)


def _is_kernel(obj) -> bool:
    from triton.runtime.jit import KernelInterface

    return isinstance(obj, KernelInterface) or type(obj).__name__ == "InterpretedFunction"


def patch_module_kernels(module) -> int:
    """Apply shim 3 to every Triton kernel object reachable from `module`'s globals."""
    count = 0
    for obj in list(vars(module).values()):
        if _is_kernel(obj):
            drop_amd_launch_options(obj)
            count += 1
    return count


def _patch_loaded_aiter_kernels() -> None:
    for name, mod in list(sys.modules.items()):
        if mod is not None and name.startswith("aiter.ops.triton"):
            patch_module_kernels(mod)


def load_triton_op(op: str):
    """Import `aiter.ops.triton.<op>` (e.g. "unified_attention", "rmsnorm", "rope").

    ROCm: plain import after `import aiter`. Elsewhere: with the shims above.
    Raises AiterUnavailable when that cannot work here."""
    if installed_version() is None and "aiter" not in sys.modules:
        raise _not_installed()
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise AiterUnavailable(f"aiter's Triton kernels need triton: {exc}") from exc
    native = is_rocm()
    if native:
        try:
            importlib.import_module("aiter")
        except Exception as exc:
            raise AiterUnavailable(f"import aiter failed on ROCm: {exc}") from exc
    else:
        register_bare_packages()
        patch_arch_info()
        patch_num_sms()
    try:
        module = importlib.import_module(f"aiter.ops.triton.{op}")
    except Exception as exc:
        raise AiterUnavailable(f"cannot load aiter.ops.triton.{op}: {exc}") from exc
    if not native:
        _patch_loaded_aiter_kernels()
    return module
