"""Paged KV-cache bookkeeping: reference-counted blocks, prefix caching and LRU
eviction.

A full block is identified by a chained xxhash64 of (previous block's hash, its token
ids), so equal prefixes map to equal block chains (as in vLLM and ATOM). Blocks whose
reference count drops to zero stay in the hash table and in an LRU free list; they are
reused on a prefix hit and evicted (hash dropped) only when a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from services.engine.sequence import Sequence


def hash_block(prev_hash: int | None, token_ids: list[int]) -> int:
    """Chained hash: a block's identity includes everything before it."""
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # a registered block's tokens: a list, compared with slices of a sequence's list
        self.token_ids: list[int] | tuple[()] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first (eviction order)
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Sum of every block's ref_count, kept as it changes so the leak audit never
        # walks the whole pool (a GPU pool holds ~100k blocks).
        self.total_refs = 0
        self.prefix_hits = 0
        self.prefix_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq's tokens. At least one
        token is always left uncached so the model has something to compute."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(self.block_hash(seq, i))
            if (
                block_id is None
                or self.blocks[block_id].token_ids != seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            hits.append(block_id)
        self.prefix_queries += max_blocks
        self.prefix_hits += len(hits)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register hashes for blocks of seq whose KV is now fully computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            h = self.block_hash(seq, i)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h in self.hash_to_block:
                continue  # same content already cached in another block: keep that one
            block.block_hash = h
            block.token_ids = seq.token_ids[i * bs : (i + 1) * bs]
            self.hash_to_block[h] = block.block_id

    def block_hash(self, seq: Sequence, i: int) -> int:
        """The chained hash of seq's token block i (full), made once per sequence and
        kept on it: a prompt that waits for memory is looked up again every step, and
        its blocks are hashed again when they join the cache."""
        hashes = seq.token_block_hashes
        bs = self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(
                hash_block(hashes[-1] if j else None, seq.token_ids[j * bs : (j + 1) * bs])
            )
        return hashes[i]

    # -- allocation ---------------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Start seq's block table with prefix-cache hits (takes a reference on each)."""
        assert not seq.block_table
        for block_id in cached_block_ids:
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(cached_block_ids) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.block_hashes = [self.blocks[b].block_hash for b in cached_block_ids]

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens. All or nothing."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block_id, _ = self.free_blocks.popitem(last=False)
            self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        self.total_refs += need
        return True

    def free(self, seq: Sequence) -> None:
        # Release tail first so the LRU evicts a sequence's last blocks before its
        # prefix, which is the part most likely to be shared.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        self.total_refs -= len(seq.block_table)
        # a new list, never the old one cleared: a block table only grows, which the
        # graph runners' staging relies on (block_table_staging.py)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_blocks):
            self._evict(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1
        self.total_refs += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
