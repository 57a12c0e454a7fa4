"""The sliding-window layers' own block pool: blocks behind every query's window are released
as a sequence moves on, prefix hits stay exact, and outputs do not change."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.kv_cache_manager import KVCacheManager
from kvlab.cache.pool_sizes import CacheBudget, pool_sizes
from kvlab.cache.window_blocks import WindowSpec
from kvlab.config import ModelConfig
from kvlab.engine import Engine, EngineConfig
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build

BS = 4


def manager(window: int = 6, num_window: int = 16, num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, window=WindowSpec(window, num_window))


def run(m: KVCacheManager, seq_id: str, tokens: list[int], chunk: int) -> None:
    """Compute tokens in chunks as the scheduler does: allocate, cache, release."""
    blocks, done = m.get_computed_blocks(tokens)
    first = True
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert m.allocate_slots(seq_id, done + n, blocks if first else None)
        first = False
        done += n
        m.cache_full_blocks(seq_id, tokens, done)
        m.release_out_of_window(seq_id, done)


def test_first_block_a_query_sees():
    m = manager(window=6)
    assert [m.window.first_block(p) for p in (0, 5, 6, 8, 9, 13)] == [0, 0, 0, 0, 1, 2]
    # a query at 9 sees keys 4..9: block 1 on; at 13 it sees 8..13: block 2 on


def test_blocks_behind_the_window_are_released_at_once():
    m = manager(window=6)
    run(m, "s", list(range(20)), chunk=3)
    table = m.window_table("s")
    # the next query is at 20 and sees keys 15..20: blocks 0-2 released, 3 and 4 held
    assert table[:3] == [None, None, None] and None not in table[3:]
    assert len(table) == len(m.block_table("s")) == 5
    assert m.window.pool.num_free_blocks == 16 - 2
    m.free("s")
    assert m.window.pool.num_free_blocks == 16 and m.num_free_blocks == 16


def test_prefix_hit_needs_the_window_blocks_of_its_last_tokens():
    m = manager(window=6, num_window=6)
    prompt = list(range(17))
    run(m, "a", prompt, chunk=17)
    m.free("a")
    blocks, n = m.get_computed_blocks(prompt)  # 4 full blocks, window blocks 2, 3 cached
    assert n == 16
    assert m.allocate_slots("b", 17, blocks)
    table = m.window_table("b")  # blocks 0, 1 are behind the window; block 2 is the hit's
    assert table[:2] == [None, None] and table[2] is not None
    m.free("b")
    # fill the window pool with another sequence: the cached window blocks are evicted
    run(m, "c", [90 + i for i in range(24)], chunk=24)
    m.free("c")
    blocks, n = m.get_computed_blocks(prompt)
    assert n == 0 and blocks == []  # full blocks still cached, their window KV is not


def test_a_hit_is_cut_back_to_where_the_window_is_still_cached():
    """A shared start keeps its window blocks warm; the rest of a long prompt's are evicted."""
    m = manager(window=6, num_window=16, num_blocks=64)
    a = list(range(33))
    run(m, "a", a, chunk=33)  # window blocks of a: 9, the first 7 released after the step
    m.free("a")
    run(m, "b", a[:17] + list(range(100, 116)), chunk=33)  # hits a's first 4 blocks
    m.free("b")
    run(m, "x", list(range(200, 240)), chunk=40)  # 10 window blocks: evicts a's blocks 4-7
    m.free("x")
    # a query at 32 needs a's window blocks 6, 7 (gone); at 16 blocks 2, 3, which b reused
    blocks, n = m.get_computed_blocks(a)
    assert n == 16 and len(blocks) == 4
    assert m.allocate_slots("a2", 33, blocks)
    assert m.window_table("a2")[:2] == [None, None] and None not in m.window_table("a2")[2:]


def test_pool_sizes_never_give_the_full_pool_less_than_one_shared_pool():
    config = ModelConfig("gemma3", 262144, 640, 18, 4, 1, 256, 2048, 32768,
                         sliding_window=512,
                         layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                           for i in range(18)))
    budget = CacheBudget(2, 16, 2 * 2**30, 16, 512)
    shared = pool_sizes(config, budget, windowed=False)
    pools = pool_sizes(config, budget, windowed=True)
    assert shared.window is None and pools.window is not None
    # 16 sequences x (32 + 2) + 512 / 16 + 1 = 577 blocks running, twice that in all
    assert pools.window.num_blocks == 2 * 577
    assert pools.num_blocks > 4 * shared.num_blocks  # 3 of 18 layers keep every position
    tight = CacheBudget(2, 16, 2**20, 16, 512)
    assert pool_sizes(config, tight, True).num_blocks >= pool_sizes(config, tight, False).num_blocks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-window")
    return build("gemma3", out), out / "model.gguf"  # window 4 on 5 of 6 layers


def test_runner_reads_the_same_keys_through_either_pool(gemma):
    """Same steps through a shared pool and through a window pool: the same logits bits."""
    _, path = gemma
    loaded = load_model(open_checkpoint(path), LoadOptions())
    shared = ModelRunner(loaded.model, loaded.config, 16, BS, kv_dtype="f16")
    own = ModelRunner(loaded.model, loaded.config, 16, BS, kv_dtype="f16", num_window_blocks=3)
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    table = [9, 3, 11, 0]
    # window 4: a query at 6 sees keys 3..6 (block 0 on), at 9 keys 6..9 (block 1 on)
    windows = [[2, 0], [2, 0, 1], [None, 0, 1], [None, 0, 1]]
    steps = [(0, ids[:6], windows[0]), (6, ids[6:9], windows[1]), (9, [ids[9]], windows[2]),
             (10, [ids[10]], windows[3])]
    for start, chunk, window in steps:
        a = shared.execute(SchedulerOutput([ScheduledSeq("a", start, chunk, table, True, 0)]))
        b = own.execute(SchedulerOutput([ScheduledSeq("a", start, chunk, table, True, 0,
                                                      window)]))
        assert torch.equal(a.logits, b.logits), f"step at {start}"


def test_engine_holds_only_the_window_and_keeps_greedy_output(gemma):
    hf, path = gemma
    prompt = list(range(3, 40))
    e = Engine.from_model(str(path), EngineConfig(block_size=BS, max_num_batched_tokens=8))
    assert e.kv.window is not None
    e.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    held, out = [], []
    while e.has_unfinished():
        for o in e.step():
            out.extend(o.new_token_ids)
        table = e.kv.window_table("r")
        if table is not None:
            held.append(sum(b is not None for b in table))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                      min_new_tokens=12)
    assert out == ref[0, len(prompt):].tolist()
    assert max(held) <= 4  # window 4 + a chunk of 8 spans at most 4 blocks of 4
    assert e.kv.window.pool.num_free_blocks == e.kv.window.pool.num_blocks


def test_info_and_metrics_state_what_the_window_pool_holds(gemma):
    from kvlab.cli.info import describe

    _, path = gemma
    info = describe(load_model(open_checkpoint(path), LoadOptions()), str(path))
    # 6 layers, 5 sliding (window 4), 2 KV heads of 16: K and V, 128 bytes a layer in f16
    assert info["sliding_layers"] == 5
    assert info["kv_full_bytes_per_token_f16"] == 128
    assert info["kv_window_bytes_f16"] == 5 * 128 * 4
    e = Engine.from_model(str(path), EngineConfig(block_size=BS, kv_dtype="f16"))
    assert e.cost.window_released
    assert e.cost.kv_bytes_held(100) == pytest.approx(128 * 100 + 5 * 128 * 4)
    assert e.cost.kv_bytes_held(3) == pytest.approx(6 * 128 * 3)
