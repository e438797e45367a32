"""Block manager accounting: reference counts, prefix hits, LRU eviction."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence


def _seq(name, tokens):
    return Sequence(name, list(tokens), SamplingParams())


def _admit(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
    assert bm.allocate(seq, seq.num_tokens)
    bm.cache_full_blocks(seq, seq.num_tokens)


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq("a", range(10))  # 2 full blocks + 2 tokens
    _admit(bm, a)
    assert bm.num_free_blocks == 7
    b = _seq("b", list(range(8)) + [50, 51, 52])
    _admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6
    bm.free(a)
    assert bm.num_free_blocks == 7  # shared blocks still held by b
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_cached_blocks_survive_free_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])
    _admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = _seq("again", [1, 2, 3, 4, 9])
    assert len(bm.find_cached_prefix(again)) == 2
    # A different sequence needing all four blocks evicts the cached ones.
    other = _seq("other", [7, 7, 8, 8, 6, 6, 5])
    _admit(bm, other)
    assert bm.find_cached_prefix(_seq("x", [1, 2, 3, 4, 9])) == []
    bm.free(other)
    assert bm.num_free_blocks == 4


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq("a", range(8))
    _admit(bm, a)
    b = _seq("b", range(8))
    assert len(bm.find_cached_prefix(b)) == 1  # 7 tokens usable: one full block


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = _seq("s", range(20))
    assert not bm.allocate(seq, 20)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = _seq("a", range(6))
    _admit(bm, a)
    bm.free(a)
    assert bm.find_cached_prefix(_seq("b", range(6))) == []


def test_running_reference_total_matches_the_pool_through_random_work():
    """The leak audit trusts total_refs instead of walking the pool: it must equal the
    sum of every block's ref_count after any mix of shared prefixes, growth and frees."""
    import random

    rng = random.Random(7)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: list[Sequence] = []
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = [1, 2, 3, 4, 5, 6, 7, 8][: rng.choice([0, 4, 8])]
            seq = _seq(f"s{step}", prefix + [rng.randrange(100) for _ in range(rng.randint(1, 9))])
            bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
            if bm.allocate(seq, seq.num_tokens):
                bm.cache_full_blocks(seq, seq.num_tokens)
                live.append(seq)
            else:
                bm.free(seq)
        assert bm.total_refs == sum(b.ref_count for b in bm.blocks)
    for seq in live:
        bm.free(seq)
    assert bm.total_refs == 0 and bm.num_free_blocks == 32


def test_a_waiting_prompt_is_hashed_once(monkeypatch):
    """A prompt that waits for memory is looked up every step, and its blocks are
    hashed again when they join the cache: each of its blocks is hashed once, and the
    lookups still follow the cache as it changes (hits, a miss after eviction)."""
    from services.engine import block_manager as bm_module

    calls = []
    real = bm_module.hash_block
    monkeypatch.setattr(bm_module, "hash_block", lambda *a: calls.append(1) or real(*a))
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])
    _admit(bm, a)  # blocks [1, 2] and [3, 4] cached
    cached = a.block_table[:2]
    bm.free(a)
    waiting = _seq("w", [1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14])  # 6 blocks: needs 4 more
    hog = _seq("hog", [20, 21, 22])  # holds 2 of the 4 free blocks
    assert bm.allocate(hog, hog.num_tokens)
    calls.clear()
    for _ in range(3):  # three steps: hits, then too few blocks, all given back
        hits = bm.find_cached_prefix(waiting)
        assert hits == cached
        bm.allocate_prefix(waiting, hits)
        assert not bm.allocate(waiting, waiting.num_tokens)
        bm.free(waiting)
    assert len(calls) == 3  # blocks 0, 1 and the first miss, block 2: once each
    bm.free(hog)
    _admit(bm, waiting)
    assert len(calls) == 5  # registering: only blocks 3 and 4 were new
    assert waiting.block_hashes == waiting.token_block_hashes[:5]
    bm.free(waiting)
    # a different sequence evicts the cached blocks: the same prompt misses now
    other = _seq("other", list(range(100, 111)))
    _admit(bm, other)
    assert bm.find_cached_prefix(_seq("w2", waiting.token_ids)) == []
    bm.free(other)
    assert bm.total_refs == 0 and bm.num_free_blocks == 6
