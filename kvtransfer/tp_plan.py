"""What one source TP rank writes into one destination TP rank, per block.

With the "block_head_major" layout a block is its rank's KV heads one after the other,
each ``head_bytes`` long. A source rank writes into a destination rank the heads both
hold; a head replicated on several source ranks (tp_size > total_kv_heads) is written
only by the lowest of them, so over all source ranks every destination byte is written
exactly once. Heads that sit next to each other on both sides merge into one chunk.

Pure arithmetic on KVLayouts: no torch, no backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtransfer.layout import (
    KVLayout,
    KVLayoutMismatch,
    check_compatible,
    kv_heads_of_rank,
    to_regions,
)

# (offset in the source block, offset in the destination block, length), in bytes
Chunk = tuple[int, int, int]


def check_tp_pair(src_tp_size: int, dst_tp_size: int, total_kv_heads: int) -> None:
    """Raise KVLayoutMismatch (a ValueError) naming the side whose TP degree cannot
    split total_kv_heads; when both can, every pairing of their ranks is writable."""
    for side, tp in (("source", src_tp_size), ("destination", dst_tp_size)):
        try:
            kv_heads_of_rank(total_kv_heads, tp, 0)
        except ValueError as exc:
            raise KVLayoutMismatch(
                f"{side} tp_size {tp} cannot hold total_kv_heads {total_kv_heads}: {exc}",
                ("tp_size", "total_kv_heads"),
            ) from None


def writer_rank(head: int, total_kv_heads: int, src_tp_size: int) -> int:
    """The one source rank that writes `head`: the lowest rank holding it."""
    if not 0 <= head < total_kv_heads:
        raise ValueError(f"head {head} out of range for total_kv_heads {total_kv_heads}")
    kv_heads_of_rank(total_kv_heads, src_tp_size, 0)  # validates the pair
    if src_tp_size <= total_kv_heads:
        return head // (total_kv_heads // src_tp_size)
    return head * (src_tp_size // total_kv_heads)


def heads_to_write(src: KVLayout, dst: KVLayout) -> list[int]:
    """Global heads the source rank `src` writes into the destination rank `dst`."""
    check_compatible(src, dst)
    theirs = set(dst.kv_heads)
    return [
        h
        for h in src.kv_heads
        if h in theirs and writer_rank(h, src.total_kv_heads, src.tp_size) == src.tp_rank
    ]


def block_chunks(src: KVLayout, dst: KVLayout) -> list[Chunk]:
    """The byte chunks, within one block, that `src` writes into `dst`; [] when it
    writes nothing there (another source rank owns those heads)."""
    hb = src.head_bytes  # equal on both sides: check_compatible in heads_to_write
    chunks: list[Chunk] = []
    for h in heads_to_write(src, dst):
        s = (h - src.kv_heads.start) * hb
        d = (h - dst.kv_heads.start) * hb
        if chunks:
            cs, cd, n = chunks[-1]
            if s == cs + n and d == cd + n:
                chunks[-1] = (cs, cd, n + hb)
                continue
        chunks.append((s, d, hb))
    return chunks


def is_whole_block(chunks: Sequence[Chunk], src: KVLayout, dst: KVLayout) -> bool:
    """True when the chunks are the whole block on both sides (same head set): then
    runs of consecutive blocks are single regions."""
    return _covers_both(chunks, src.block_bytes, dst.block_bytes)


def _covers_both(chunks: Sequence[Chunk], src_block_bytes: int, dst_block_bytes: int) -> bool:
    return list(chunks) == [(0, 0, src_block_bytes)] and src_block_bytes == dst_block_bytes


def chunk_regions(
    runs: Iterable[tuple[int, int, int]],
    chunks: Sequence[Chunk],
    src_base: int,
    dst_base: int,
    src_block_bytes: int,
    dst_block_bytes: int,
    max_region_bytes: int,
) -> list[tuple[int, int, int]]:
    """Byte regions (src_addr, dst_addr, length) for block runs (src, dst, n) and
    per-block chunks. Whole-block chunks keep each run one region (split above
    max_region_bytes); partial ones give one region per block per chunk."""
    runs = list(runs)
    if _covers_both(chunks, src_block_bytes, dst_block_bytes):
        return to_regions(runs, src_base, dst_base, src_block_bytes, max_region_bytes)
    regions: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        for k in range(n):
            src_block = src_base + (s + k) * src_block_bytes
            dst_block = dst_base + (d + k) * dst_block_bytes
            for so, do, length in chunks:
                # a one-"block" run of `length` bytes: to_regions splits it if too long
                regions += to_regions(
                    [(0, 0, 1)], src_block + so, dst_block + do, length, max_region_bytes
                )
    return regions
