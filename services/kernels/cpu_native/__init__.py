"""`cpu_native`: the small ops of a CPU step (RMSNorm, RoPE, the KV write, paged
attention, SiLU-and-mul) as one C call each (kernels.c says why).

The C file is compiled at first use by the machine's C compiler for its own CPU and
kept beside the tuner's choices (`<kernel tuning dir>/cpu_native/<key>.so`, keyed by
the source, the compiler, the CPU and torch), so later starts only load it; where that
folder cannot be written, each start builds into a temporary one (under a second). No
compiler, or a build that fails: the candidate does not load (the tuner logs why and
times the others). Each op takes the
C path for what it covers (CPU tensors in fp32 or bf16, unit stride along the last
dimension, an unquantized KV cache) and the torch reference otherwise."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from services.kernels.cache_dir import kernel_tuning_dir
from services.kernels.cpu_info import cpu_flags_digest
from services.kernels.interface import AttentionMetadata, kv_cache_is_fp8
from services.kernels.torch_backend import TorchBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_MAX_HEAD_DIM = 1024  # rope_store_kv's cos/sin row buffer
# Attention work (query rows x keys x query heads x head_dim) above which it runs on
# every intra-op thread: below, waking the other thread costs more than it saves.
_PARALLEL_WORK = 1 << 16

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# fmt: off
_SIGNATURES = {  # argument types in kernels.c's order
    "rms_norm": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F],
    "silu_and_mul": [_P, _I64, _P, _I64, _I64],
    "rope_store_kv": [_P, _P, _I64, _P, _I64, _P, _I64, _P, _INT, _P, _P, _P, _P, _I64,
                      _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64],
    "store_kv": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64],
    "paged_attention": [_P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64,
                        _P, _I64, _I64, _I64, _I64, _I64, _F, _I64, _INT],
}
# fmt: on


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or $CC) to build the cpu_native kernels")
    return cc


def library_path() -> Path:
    """Where this machine's build lives: keyed by everything that changes the binary."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (SOURCE.read_text(), cc, version, cpu_flags_digest(), torch.__version__)
        )
    ).hexdigest()[:16]
    return kernel_tuning_dir() / "cpu_native" / f"kernels-{key}.so"


def build(path: Path) -> None:
    """Compile kernels.c into `path` (atomically: two workers may build at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    # -fopenmp links libgomp.so.1, the soname torch has already loaded: one thread pool
    cmd = [_compiler(), "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
           "-o", tmp, str(SOURCE), "-lm", "-lmvec"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        log.info("building the cpu_native kernels into %s", path)
        try:
            build(path)
        except OSError as exc:  # a read-only cache: this process's own copy
            path = Path(tempfile.mkdtemp(prefix="pdserve-cpu-native-")) / path.name
            log.info("cannot write the kernel cache (%s): building into %s", exc, path)
            build(path)
    lib = ctypes.CDLL(str(path))
    if path.parent.name.startswith("pdserve-cpu-native-"):
        shutil.rmtree(path.parent, ignore_errors=True)  # loaded: the mapping outlives it
    for name, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_ok(x: torch.Tensor) -> bool:
    """A 2-D CPU tensor in a dtype the kernels take, unit stride along its rows."""
    return x.device.type == "cpu" and x.dim() == 2 and x.dtype in _SUFFIX and x.stride(1) == 1


def _heads_ok(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with head_dim contiguous and heads back to back."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _cache_ok(cache: torch.Tensor, dtype) -> bool:
    """A [blocks, block_size, heads, head_dim] view with head_dim contiguous."""
    return cache.device.type == "cpu" and cache.dtype == dtype and cache.stride(3) == 1


class CpuNativeBackend(TorchBackend):
    name = "cpu_native"

    def __init__(self):
        self._lib = load_library()
        self._fn = {
            (name, dtype): getattr(self._lib, f"{name}_{suffix}")
            for name in _SIGNATURES
            for dtype, suffix in _SUFFIX.items()
        }

    # -- norms and activation ------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        if not (_rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()):
            return super().rms_norm(x, weight, eps)
        rows, h = x.shape
        out = torch.empty(rows, h, dtype=x.dtype)
        self._fn["rms_norm", x.dtype](
            x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(), out.data_ptr(),
            rows, h, eps,
        )  # fmt: skip
        return out

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if not (
            _rows_ok(x)
            and _rows_ok(residual)
            and residual.shape == x.shape
            and residual.dtype == weight.dtype == x.dtype
            and weight.is_contiguous()
        ):
            return super().fused_add_rms_norm(x, residual, weight, eps)
        rows, h = x.shape
        out = torch.empty(rows, h, dtype=x.dtype)
        res_out = torch.empty(rows, h, dtype=x.dtype)
        self._fn["rms_norm", x.dtype](
            x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
            res_out.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, h, eps,
        )  # fmt: skip
        return out, res_out

    def silu_and_mul(self, x):
        if not _rows_ok(x) or x.shape[1] % 2:
            return super().silu_and_mul(x)
        rows, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, inter, dtype=x.dtype)
        self._fn["silu_and_mul", x.dtype](x.data_ptr(), x.stride(0), out.data_ptr(), rows, inter)
        return out

    # -- RoPE and the KV write -----------------------------------------------------------
    def _rope_ok(self, positions, q, k, cos_sin_cache) -> bool:
        return (
            q.device.type == "cpu"
            and q.dtype in _SUFFIX
            and k.dtype == q.dtype
            and _heads_ok(q)
            and _heads_ok(k)
            and q.shape[2] == k.shape[2] <= _MAX_HEAD_DIM
            and q.shape[2] % 2 == 0
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and cos_sin_cache.dtype in (torch.float32, q.dtype)
            and cos_sin_cache.is_contiguous()
            and cos_sin_cache.shape[-1] == q.shape[2]
        )

    def _store_ok(self, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
        return (
            not kv_cache_is_fp8(k_cache, k_scale, v_scale)
            and _heads_ok(v)
            and v.dtype == k.dtype
            and _cache_ok(k_cache, k.dtype)
            and _cache_ok(v_cache, k.dtype)
            and k_cache.stride() == v_cache.stride()
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
        )

    def _rope(self, positions, q, k, cos_sin_cache, k_out, v=None, caches=None, slots=None):
        """q rotated into a new [T, Hq, D] tensor; k rotated into k_out, or with caches
        given straight into the cache slots (with v beside it)."""
        tokens, hq, d = q.shape
        q_out = torch.empty(tokens, hq, d, dtype=q.dtype)
        if caches is None:
            kc = vc = None
            cb = ct = ch = block_size = 0
        else:
            kc, vc = caches
            cb, ct, ch = kc.stride(0), kc.stride(1), kc.stride(2)
            block_size = kc.shape[1]
        self._fn["rope_store_kv", q.dtype](
            positions.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
            _ptr(v), 0 if v is None else v.stride(0), cos_sin_cache.data_ptr(),
            int(cos_sin_cache.dtype == torch.float32), q_out.data_ptr(), _ptr(k_out),
            _ptr(kc), _ptr(vc), cb, ct, ch, _ptr(slots), block_size, tokens, hq, k.shape[1], d,
        )  # fmt: skip
        return q_out

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        if not self._rope_ok(positions, q, k, cos_sin_cache):
            return super().rotary_embedding(positions, q, k, cos_sin_cache)
        k_out = torch.empty(k.shape, dtype=k.dtype)
        return self._rope(positions, q, k, cos_sin_cache, k_out), k_out

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        if not (
            k.device.type == "cpu"
            and k.dtype in _SUFFIX
            and _heads_ok(k)
            and self._store_ok(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        ):
            return super().store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        self._fn["store_kv", k.dtype](
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            slot_mapping.data_ptr(), k_cache.shape[1], k.shape[0], k.shape[1], k.shape[2],
        )  # fmt: skip

    def rope_and_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale=None, v_scale=None, qk_norm=None,
    ):  # fmt: skip
        if qk_norm is not None or not (
            self._rope_ok(positions, q, k, cos_sin_cache)
            and self._store_ok(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        ):
            return super().rope_and_store_kv(
                positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                k_scale, v_scale, qk_norm,
            )  # fmt: skip
        return self._rope(positions, q, k, cos_sin_cache, None, v, (k_cache, v_cache), slot_mapping)

    # -- attention -----------------------------------------------------------------------
    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        pass  # the kernel reads the metadata as it is

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        m = metadata
        if not (
            q.device.type == "cpu"
            and q.dtype in _SUFFIX
            and _heads_ok(q)
            and not kv_cache_is_fp8(k_cache, k_scale, v_scale)
            and _cache_ok(k_cache, q.dtype)
            and _cache_ok(v_cache, q.dtype)
            and k_cache.stride() == v_cache.stride()
            and q.shape[1] % k_cache.shape[2] == 0
            and m.cu_seqlens_q.dtype == m.seq_lens.dtype == m.block_tables.dtype == torch.int32
            and m.cu_seqlens_q.is_contiguous()
            and m.seq_lens.is_contiguous()
            and m.block_tables.stride(1) == 1
            and m.cu_seqlens_q_cpu is not None  # host lengths: no padded rows, no sync
            and m.cu_seqlens_q_cpu[-1] == q.shape[0]
        ):
            if "torch" not in m.backend_data:
                super().prepare_attention(m)
            return super().paged_attention(
                q, k_cache, v_cache, m, scale, k_scale, v_scale, sliding_window
            )
        tokens, hq, d = q.shape
        out = torch.empty(tokens, hq, d, dtype=q.dtype)
        work = tokens * m.max_seq_len * hq * d
        parallel = work > _PARALLEL_WORK and tokens * k_cache.shape[2] > 1
        threads = torch.get_num_threads() if parallel else 1
        if scale is None:
            scale = d**-0.5
        self._fn["paged_attention", q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), m.block_tables.data_ptr(),
            m.block_tables.stride(0), m.cu_seqlens_q.data_ptr(), m.seq_lens.data_ptr(),
            m.seq_lens.shape[0], k_cache.shape[1], out.data_ptr(), out.stride(0), hq,
            k_cache.shape[2], d, m.max_seq_len, scale, sliding_window or 0, threads,
        )  # fmt: skip
        return out
