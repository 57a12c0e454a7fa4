"""KVCacheManager: block tables, slot mapping, allocation limits and prefix reuse."""

import random
from collections import Counter

import pytest

from kvlab.cache import kv_cache_manager
from kvlab.cache.kv_cache_manager import KVCacheManager

BS = 4


def admit(m: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    """Admit a prompt the way the scheduler does, compute it all, cache its full blocks."""
    blocks, num_cached = m.get_computed_blocks(tokens)
    assert m.allocate_slots(seq_id, len(tokens), blocks)
    m.cache_full_blocks(seq_id, tokens, len(tokens))
    return num_cached


def test_slot_mapping_at_block_boundaries():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate_slots("x", 1)  # takes block 0, so "s" does not start at block 0
    assert m.allocate_slots("s", 10)
    table = m.block_table("s")
    assert len(table) == 3
    slots = m.slots("s", 0, 10)
    assert slots[0] == table[0] * BS
    assert slots[3] == table[0] * BS + 3  # last slot of block 0
    assert slots[4] == table[1] * BS  # first slot of block 1
    assert slots[8:] == [table[2] * BS, table[2] * BS + 1]
    assert m.slots("s", 3, 5) == [table[0] * BS + 3, table[1] * BS]
    assert m.slots("s", 12, 12) == []
    assert m.slots("s", 11, 12) == [table[2] * BS + 3]
    with pytest.raises(IndexError, match="outside its 3 blocks"):
        m.slots("s", 10, 13)


def test_allocate_grows_table_only_at_block_boundaries():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    assert m.allocate_slots("s", 4)
    assert len(m.block_table("s")) == 1
    assert m.allocate_slots("s", 4)  # already covered
    assert len(m.block_table("s")) == 1
    assert m.allocate_slots("s", 5)
    assert len(m.block_table("s")) == 2
    assert m.num_free_blocks == 6
    assert m.usage == pytest.approx(2 / 8)


def test_free_returns_all_blocks_and_unknown_is_noop():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    m.allocate_slots("a", 9)
    m.allocate_slots("b", 3)
    assert m.num_free_blocks == 2
    m.free("a")
    assert m.num_free_blocks == 5
    assert m.block_table("a") == []
    m.free("a")
    m.free("never-seen")
    m.free("b")
    assert m.num_free_blocks == 6 and m.usage == 0.0


def test_out_of_blocks_returns_false_and_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    assert m.allocate_slots("a", 8)
    assert not m.allocate_slots("b", 9)  # needs 3, 2 free
    assert m.block_table("b") == [] and m.num_free_blocks == 2
    assert not m.allocate_slots("a", 17)  # needs 3 more
    assert len(m.block_table("a")) == 2 and m.num_free_blocks == 2


def test_out_of_blocks_counts_revived_prefix_blocks():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    admit(m, "a", prompt)
    m.free("a")  # 2 cached blocks now sit in the free queue
    blocks, n = m.get_computed_blocks(prompt)
    assert n == 8
    assert m.allocate_slots("hog", 4)  # 3 free, 2 of them the cached blocks
    assert not m.allocate_slots("b", 16, blocks)  # needs 2 new, only 1 not-cached free
    assert m.block_table("b") == [] and m.num_free_blocks == 3
    assert all(m.pool.ref_count(b) == 0 for b in blocks)
    assert m.allocate_slots("b", 12, blocks)
    assert m.block_table("b")[:2] == blocks


def test_prefix_reuse_across_two_sequences():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    assert admit(m, "a", shared + [9, 10]) == 0
    assert admit(m, "b", shared + [11]) == 8
    a, b = m.block_table("a"), m.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [m.pool.ref_count(x) for x in b] == [2, 2, 1]
    assert m.prefix_stats.queries == 10 + 9 and m.prefix_stats.hits == 8
    m.free("a")
    assert [m.pool.ref_count(x) for x in b] == [1, 1, 1]


def test_never_the_whole_prompt():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(8))
    admit(m, "a", prompt)
    blocks, n = m.get_computed_blocks(prompt)  # (8 - 1) // 4 = 1 block at most
    assert n == 4 and blocks == m.block_table("a")[:1]
    blocks, n = m.get_computed_blocks(prompt + [99])
    assert n == 8
    assert m.get_computed_blocks([]) == ([], 0)


def test_get_computed_blocks_takes_no_references():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    admit(m, "a", list(range(5)))
    m.free("a")
    free_before = m.num_free_blocks
    blocks, _ = m.get_computed_blocks(list(range(5)))
    assert blocks and m.num_free_blocks == free_before
    assert m.pool.ref_count(blocks[0]) == 0


def test_revived_cached_block():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = [5, 6, 7, 8, 9]
    admit(m, "a", prompt)
    first = m.block_table("a")[0]
    m.free("a")
    assert m.num_free_blocks == 4 and m.pool.is_cached(first)
    assert admit(m, "b", prompt) == 4
    assert m.block_table("b")[0] == first
    assert m.pool.ref_count(first) == 1 and first not in m.pool.free_queue()
    assert m.num_free_blocks == 2


def test_lru_eviction_tail_of_sequence_first():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a_prompt = list(range(100, 113))  # 3 full blocks + 1 token
    admit(m, "a", a_prompt)
    a = m.block_table("a")
    m.free("a")
    # a's uncached partial block at the head, its cached blocks tail first, head last
    assert m.pool.free_queue() == [a[3], 4, 5, a[2], a[1], a[0]]
    assert m.allocate_slots("b", 12)  # a's partial block and the 2 never used
    assert all(m.pool.is_cached(x) for x in a[:3])
    assert m.allocate_slots("c", 4)  # evicts a's last full block, the LRU cached one
    assert m.block_table("c") == [a[2]] and not m.pool.is_cached(a[2])
    blocks, n = m.get_computed_blocks(a_prompt)
    assert blocks == a[:2] and n == 8


def test_never_caches_partial_or_uncomputed_blocks():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(10))
    assert m.allocate_slots("a", 10)
    table = m.block_table("a")
    m.cache_full_blocks("a", tokens, 6)  # chunked prefill: only block 0 fully computed
    assert [m.pool.is_cached(b) for b in table] == [True, False, False]
    m.cache_full_blocks("a", tokens, 10)
    assert [m.pool.is_cached(b) for b in table] == [True, True, False]
    # decode fills block 2: it is cached once its tokens are computed
    tokens += [10, 11]
    m.allocate_slots("a", 12)
    m.cache_full_blocks("a", tokens, 11)
    assert not m.pool.is_cached(table[2])
    m.cache_full_blocks("a", tokens, 12)
    assert m.pool.is_cached(table[2])


def test_hash_collision_rechecks_tokens(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens: 42)
    m = KVCacheManager(num_blocks=8, block_size=BS)
    admit(m, "a", [1, 2, 3, 4, 5])
    assert m.get_computed_blocks([9, 9, 9, 9, 5]) == ([], 0)  # same key, other tokens
    assert admit(m, "b", [1, 2, 3, 4, 5]) == 4  # the true match still hits
    # a second block of a: its key 42 is taken by block 0, so caching stops there
    admit(m, "c", [1, 2, 3, 4, 6, 6, 6, 6, 7])
    assert not m.pool.is_cached(m.block_table("c")[1])


def test_hash_collision_rechecks_the_parent(monkeypatch):
    # a key that ignores the parent: block "c" after "a" and after "b" collide
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    m = KVCacheManager(num_blocks=12, block_size=BS)
    a, b, c, d = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    admit(m, "ac", a + c + [0])
    admit(m, "bd", b + d + [0])
    blocks, n = m.get_computed_blocks(b + c + [0])
    assert blocks == m.block_table("bd")[:1] and n == 4  # "c" cached after "a", not after "b"


def test_identical_prompts_computed_concurrently_share_the_cache():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    for seq in ("a", "b"):  # both admitted before either is computed: no hit
        blocks, n = m.get_computed_blocks(prompt)
        assert n == 0 and m.allocate_slots(seq, len(prompt), blocks)
    for seq in ("a", "b"):
        m.cache_full_blocks(seq, prompt, len(prompt))
    a, b = m.block_table("a"), m.block_table("b")
    assert all(m.pool.is_cached(x) for x in a[:2])
    assert not any(m.pool.is_cached(x) for x in b)
    # b links its later blocks to a's chain
    tail = [9, 10, 11, 12]
    b_tokens = prompt + tail[:3]
    m.allocate_slots("b", len(b_tokens))
    m.cache_full_blocks("b", b_tokens, len(b_tokens))
    blocks, n = m.get_computed_blocks(b_tokens + [0])
    assert blocks == a[:2] + [b[2]] and n == 12


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    admit(m, "a", prompt)
    assert not any(m.pool.is_cached(x) for x in m.block_table("a"))
    assert admit(m, "b", prompt) == 0
    assert m.prefix_stats.queries == 0


def test_computed_blocks_only_on_first_call():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    admit(m, "a", list(range(5)))
    blocks, _ = m.get_computed_blocks(list(range(5)))
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate_slots("a", 8, blocks)


def test_random_workload_keeps_invariants_under_collisions(monkeypatch):
    """Random admits and frees with a tiny key space: counts stay exact, hits stay correct."""
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda p, t: hash((p, t)) % 5)
    rng = random.Random(0)
    bs = 2
    m = KVCacheManager(num_blocks=16, block_size=bs)
    content: dict[int, tuple[int, ...]] = {}  # block id -> the whole prefix its KV was made for
    live: dict[str, list[int]] = {}
    for step in range(400):
        if live and rng.random() < 0.4:
            seq_id = rng.choice(sorted(live))
            del live[seq_id]
            m.free(seq_id)
            continue
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        blocks, _ = m.get_computed_blocks(prompt)
        for i, b in enumerate(blocks):
            assert content[b] == tuple(prompt[:(i + 1) * bs])
        free_before = m.num_free_blocks
        if not m.allocate_slots(f"s{step}", len(prompt), blocks):
            assert m.num_free_blocks == free_before
            continue
        m.cache_full_blocks(f"s{step}", prompt, len(prompt))
        table = m.block_table(f"s{step}")
        for i, b in enumerate(table):
            if (i + 1) * bs <= len(prompt):
                content[b] = tuple(prompt[:(i + 1) * bs])
            else:
                content.pop(b, None)
        live[f"s{step}"] = prompt
        refs = Counter(b for seq in live for b in m.block_table(seq))
        assert all(m.pool.ref_count(b) == refs[b] for b in range(m.num_blocks))
        assert m.num_free_blocks == m.num_blocks - len(refs)
    assert m.prefix_stats.hits > 0
