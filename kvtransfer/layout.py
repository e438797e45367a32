"""KV-cache layout description, the compatibility check and block-run coalescing.

The engine allocates one contiguous KV buffer per worker rank shaped
``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]`` ("block_head_major"),
num_kv_heads being the rank's own KV heads under tensor parallelism (TP). Block ``i`` is
one contiguous region at ``base + i * block_bytes``, so a run of consecutive block ids is
one contiguous region; inside a block each KV head is one contiguous chunk of
``head_bytes``, so any range of heads is one chunk too. Ranks of different TP degrees
therefore exchange a few large head chunks per block (kvtransfer/tp_plan.py), and ranks
holding the same heads exchange whole block runs. Only integer addresses and byte
counts here (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

# Bytes per element for the KV dtypes we accept. Names follow torch/numpy spelling so the
# engine can pass str(torch_dtype) (a "torch." prefix is stripped).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

# Only one layout exists today; the name travels in the handshake so another layout
# (e.g. the older block-major one, heads innermost) is rejected at registration time
# instead of corrupting KV.
LAYOUTS: tuple[str, ...] = ("block_head_major",)

# Fields that must agree between the two ends of a transfer. num_blocks may differ (each
# side sizes its own pool), and so may tp_size / tp_rank / num_kv_heads: each rank holds
# a slice of the model's total_kv_heads. Blocks move as bytes, so an FP8 cache's
# per-layer scales must agree too: the same bytes under another scale are other values.
COMPAT_FIELDS: tuple[str, ...] = (
    "layout",
    "dtype",
    "block_size",
    "num_layers",
    "total_kv_heads",
    "head_dim",
    "k_scales",
    "v_scales",
)
_SCALE_FIELDS = ("k_scales", "v_scales")


class KVLayoutMismatch(ValueError):
    """The two ends of a transfer disagree on how KV blocks are laid out."""

    def __init__(self, message: str, fields: Sequence[str] = ()):
        super().__init__(message)
        self.fields: tuple[str, ...] = tuple(fields)


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; reject it so True never silently means 1 block.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads that TP rank `rank` of `tp_size` holds.

    tp_size <= total_kv_heads: an equal contiguous share each. tp_size > total_kv_heads:
    one head each, every head replicated on tp_size // total_kv_heads consecutive ranks
    (as vLLM does). Raises ValueError naming both numbers for any other pair.
    """
    _check_int("total_kv_heads", total_kv_heads, 1)
    _check_int("tp_size", tp_size, 1)
    _check_int("tp_rank", rank, 0)
    if rank >= tp_size:
        raise ValueError(f"tp_rank {rank} out of range for tp_size {tp_size}")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(
                f"total_kv_heads {total_kv_heads} is not divisible by tp_size {tp_size}"
            )
        per_rank = total_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % total_kv_heads:
        raise ValueError(
            f"tp_size {tp_size} is not a multiple of total_kv_heads {total_kv_heads} "
            "(needed to replicate KV heads over more ranks than heads)"
        )
    head = rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one worker rank's KV pool; a transfer moves blocks or head
    chunks of blocks. total_kv_heads 0 means num_kv_heads (no TP)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    layout: str = "block_head_major"
    # Scaled caches (FP8): each layer's K and V scale (stored = value / scale), one per
    # layer; empty for a cache that stores values as they are.
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    # Tensor parallelism: this rank's place and the model's KV head count; num_kv_heads
    # must be what kv_heads_of_rank gives this rank.
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        for name in _SCALE_FIELDS:
            object.__setattr__(self, name, self._scales(name))  # frozen: normalise once
        if bool(self.k_scales) != bool(self.v_scales):
            raise ValueError("k_scales and v_scales must be given together")
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a str, got {type(self.dtype).__name__}")
        dtype = self.dtype.removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_SIZES)}")
        object.__setattr__(self, "dtype", dtype)  # frozen: normalise once here
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        _check_int("tp_size", self.tp_size, 1)
        _check_int("tp_rank", self.tp_rank, 0)
        _check_int("total_kv_heads", self.total_kv_heads, 0)
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)  # frozen
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        heads = kv_heads_of_rank(self.total_kv_heads, self.tp_size, self.tp_rank)
        if self.num_kv_heads != len(heads):
            raise ValueError(
                f"num_kv_heads {self.num_kv_heads} does not match the {len(heads)} heads that "
                f"tp_rank {self.tp_rank} of tp_size {self.tp_size} holds out of "
                f"total_kv_heads {self.total_kv_heads}"
            )

    def _scales(self, name: str) -> tuple[float, ...]:
        value = getattr(self, name)
        try:  # a tuple, a JSON list or a protobuf repeated field
            if isinstance(value, (str, bytes)):
                raise TypeError
            scales = tuple(value)
        except TypeError:
            raise ValueError(f"{name} must be a sequence of floats, got {value!r}") from None
        for s in scales:
            ok = isinstance(s, (int, float)) and not isinstance(s, bool)
            if not ok or not math.isfinite(s) or s <= 0:
                raise ValueError(f"{name} must hold positive finite floats, got {s!r}")
        if scales and len(scales) != self.num_layers:
            raise ValueError(
                f"{name} has {len(scales)} entries for {self.num_layers} layers (one per layer)"
            )
        return tuple(float(s) for s in scales)

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_heads(self) -> range:
        """The global KV heads this rank holds, in the order they sit in a block."""
        return kv_heads_of_rank(self.total_kv_heads, self.tp_size, self.tp_rank)

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head within a block: all layers' K and V for its tokens."""
        return self.num_layers * 2 * self.block_size * self.head_dim * self.dtype_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every local head's chunk, one after the other."""
        return self.num_kv_heads * self.head_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in _SCALE_FIELDS:
            out[name] = list(out[name])  # JSON and protobuf repeated fields
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        # Unknown keys are ignored so a newer peer can add fields without breaking us.
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:  # missing required keys
            raise ValueError(f"bad KVLayout dict {data!r}: {exc}") from None


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise KVLayoutMismatch naming every field where local and remote disagree."""
    diffs = [f for f in COMPAT_FIELDS if getattr(local, f) != getattr(remote, f)]
    if diffs:
        detail = ", ".join(_describe(f, getattr(local, f), getattr(remote, f)) for f in diffs)
        raise KVLayoutMismatch(f"incompatible KV layouts ({detail})", diffs)


def _describe(field: str, mine: Any, theirs: Any) -> str:
    if field not in _SCALE_FIELDS:
        return f"{field}: local={mine!r} remote={theirs!r}"
    # one entry per layer: name the first layer that differs, not two long lists
    if len(mine) != len(theirs):
        return f"{field}: local has {len(mine) or 'none'}, remote {len(theirs) or 'none'}"
    layer = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    return f"{field}: layer {layer} local={mine[layer]!r} remote={theirs[layer]!r}"


def coalesce(
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Turn (src, dst) block pairs into runs (src_start, dst_start, num_blocks).

    A run is a set of pairs where both src and dst ids are consecutive, so it is one
    contiguous region on each side. Pairs are grouped by their diagonal (dst - src)
    first, which makes the result minimal even for unsorted input or a source block
    sent to several destinations. Runs come back ordered by dst_start.
    """
    src = list(src_block_ids)
    dst = list(dst_block_ids)
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} block ids but dst has {len(dst)}")
    for name, ids in (("src", src), ("dst", dst)):
        for b in ids:
            _check_int(f"{name} block id", b, 0)
    if len(set(dst)) != len(dst):
        seen: set[int] = set()
        dups = sorted({b for b in dst if b in seen or seen.add(b)})
        raise ValueError(f"duplicate dst block ids: {dups[:10]}")

    runs: list[tuple[int, int, int]] = []
    # On one diagonal dst ids are unique, hence src ids too: consecutive src == a run.
    for s, d in sorted(zip(src, dst), key=lambda p: (p[1] - p[0], p[0])):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    runs.sort(key=lambda r: r[1])
    return runs


def to_regions(
    runs: Iterable[tuple[int, int, int]],
    src_base: int,
    dst_base: int,
    block_bytes: int,
    max_region_bytes: int,
) -> list[tuple[int, int, int]]:
    """Turn block runs into byte regions (src_addr, dst_addr, length).

    Regions longer than max_region_bytes are split so no single request is unbounded
    (transports time out per request in proportion to its size).
    """
    _check_int("block_bytes", block_bytes, 1)
    _check_int("max_region_bytes", max_region_bytes, 1)
    regions: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        src_addr = src_base + s * block_bytes
        dst_addr = dst_base + d * block_bytes
        length = n * block_bytes
        for off in range(0, length, max_region_bytes):
            regions.append((src_addr + off, dst_addr + off, min(max_region_bytes, length - off)))
    return regions


def batched(items: Sequence[Any], max_batch: int) -> list[Sequence[Any]]:
    """Split items into consecutive chunks of at most max_batch."""
    _check_int("max_batch", max_batch, 1)
    return [items[i : i + max_batch] for i in range(0, len(items), max_batch)]
