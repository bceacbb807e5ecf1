"""Block pool invariants: ref counts, the LRU free queue, prefix-cache naming."""
import pytest

from tandem.engine.block_hash import extend_block_hashes, hash_block
from tandem.engine.block_pool import BlockPool


def test_allocate_and_free_restore_the_free_count():
    pool = BlockPool(10)
    start = pool.num_free_blocks
    blocks = pool.allocate(4)
    assert pool.num_free_blocks == start - 4
    assert all(b.ref_cnt == 1 for b in blocks)
    assert 0 not in [b.block_id for b in blocks], "block 0 is reserved for padding"
    pool.free(blocks)
    assert pool.num_free_blocks == start
    assert all(b.ref_cnt == 0 for b in blocks)


def test_ref_count_never_goes_negative():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_cache_hit_on_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h1")
    pool.free([block])
    assert pool.get_cached_block(b"h1") is block  # freeing does not evict
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue


def test_cached_blocks_are_evicted_lru_only_when_reallocated():
    pool = BlockPool(4)  # 3 usable
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h)
    pool.free([b])
    pool.free([a])
    pool.free([c])  # free order b, a, c: b is least recently freed
    assert pool.get_cached_block(b"b") is b
    (first,) = pool.allocate(1)
    assert first is b and pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"c") is c
    assert pool.num_evictions == 1


def test_block_hashes_chain_through_parents():
    tokens = list(range(48))
    hashes = extend_block_hashes([], tokens, 16)
    assert len(hashes) == 3
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # same block content under a different parent is a different block
    assert hash_block(None, tokens[16:32]) != hashes[1]
    # extra keys (the model) separate otherwise equal blocks
    assert hash_block(None, tokens[:16], b"model-a") != hash_block(None, tokens[:16], b"model-b")
    # partial blocks are not hashed
    assert len(extend_block_hashes([], tokens[:47], 16)) == 2


def test_block_hashes_are_stable_bytes():
    # Blocks saved to a store by an earlier build must still be found: the
    # hashed bytes (parent, tokens as little-endian int64, extra) never change.
    first = hash_block(None, list(range(16)), b"m|torch.bfloat16")
    assert first.hex() == "135c1ef6600e21e667e911e665580c8673b76cf7607cbd9de312c47138b5fdc0"
    assert hash_block(first, [7] * 16).hex() == \
        "8d551a692a4bbe06d3dd1ed8c8262363e1aa9c03771e6d7d7061915cae4cbc57"
    second = hash_block(first, [7] * 16)
    assert hash_block(second, [2**40, 3], b"x").hex() == \
        "6068fe2b162b2f519a368df5c5a6f0498ce8e644409ae4811f9ee5f8be161437"
