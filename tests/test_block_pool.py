"""BlockPool: ref-counts, LRU free queue, the prefix hash map and its collision checks."""

import pytest

from kvlab.cache.block_pool import BlockPool, hash_block_tokens

BS = 4


def cache_chain(pool: BlockPool, block_ids: list[int], token_blocks: list[tuple[int, ...]]):
    """Register block_ids as one prefix chain; return the content_id links."""
    key, link, links = None, None, []
    for block_id, tokens in zip(block_ids, token_blocks):
        key = hash_block_tokens(key, tokens)
        link = pool.cache_block(block_id, key, tokens, link)
        links.append(link)
    return links


def test_allocate_and_free_accounting():
    pool = BlockPool(num_blocks=5, block_size=BS)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.num_free_blocks == 2
    assert all(pool.ref_count(b) == 1 for b in ids)
    pool.touch([1])
    pool.free([1])
    assert pool.ref_count(1) == 1 and pool.num_free_blocks == 2
    pool.free(ids)
    assert pool.num_free_blocks == 5


def test_allocate_more_than_free_raises():
    pool = BlockPool(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_raises():
    pool = BlockPool(num_blocks=2, block_size=BS)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([b])


def test_uncached_blocks_go_to_head_cached_to_tail():
    pool = BlockPool(num_blocks=3, block_size=BS)
    a, b, c = pool.allocate(3)
    cache_chain(pool, [a], [(1, 2, 3, 4)])
    pool.free([a, b])  # a is cached: tail; b holds nothing: head
    assert pool.free_queue() == [b, a]
    pool.free([c])
    assert pool.free_queue() == [c, b, a]


def test_lru_eviction_order_and_hash_entry_dropped():
    pool = BlockPool(num_blocks=3, block_size=BS)
    ids = pool.allocate(3)
    toks = [(i, i, i, i) for i in range(3)]
    for block_id, t in zip(ids, toks):
        cache_chain(pool, [block_id], [t])
    pool.free([ids[2], ids[0], ids[1]])  # least recently freed = ids[2]
    assert pool.free_queue() == [ids[2], ids[0], ids[1]]
    [got] = pool.allocate(1)
    assert got == ids[2]
    assert not pool.is_cached(got)
    assert pool.lookup(hash_block_tokens(None, toks[2]), toks[2], None) is None
    assert pool.lookup(hash_block_tokens(None, toks[0]), toks[0], None).block_id == ids[0]


def test_revive_cached_block_from_free_queue():
    pool = BlockPool(num_blocks=2, block_size=BS)
    [b] = pool.allocate(1)
    cache_chain(pool, [b], [(5, 6, 7, 8)])
    pool.free([b])
    assert pool.num_free_blocks == 2
    hit = pool.lookup(hash_block_tokens(None, (5, 6, 7, 8)), (5, 6, 7, 8), None)
    assert hit is not None and hit.block_id == b
    pool.touch([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    assert b not in pool.free_queue() and pool.is_cached(b)


def test_partial_block_rejected():
    pool = BlockPool(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="only full blocks"):
        pool.cache_block(0, 1, (1, 2, 3), None)


def test_key_collision_on_insert_and_lookup():
    pool = BlockPool(num_blocks=2, block_size=BS)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 99, (1, 1, 1, 1), None) is not None
    assert pool.cache_block(b, 99, (2, 2, 2, 2), None) is None  # same key, other tokens
    assert not pool.is_cached(b)
    assert pool.lookup(99, (2, 2, 2, 2), None) is None
    assert pool.lookup(99, (1, 1, 1, 1), None).block_id == a


def test_duplicate_content_links_to_existing_entry():
    pool = BlockPool(num_blocks=2, block_size=BS)
    a, b = pool.allocate(2)
    link_a = pool.cache_block(a, 7, (1, 2, 3, 4), None)
    assert pool.cache_block(b, 7, (1, 2, 3, 4), None) == link_a
    assert pool.is_cached(a) and not pool.is_cached(b)
