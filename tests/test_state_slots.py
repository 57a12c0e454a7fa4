"""State slots of hybrid models without a model: the slot table, the KV cache manager that
owns it, the scheduler's admission and preemption, and the pool sizing that pays for it."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.cache import KVCacheManager
from kvlab.cache.pool_sizes import CacheBudget, pool_sizes
from kvlab.cache.state_slots import StateSlots
from kvlab.config import ModelConfig, RecurrentConfig
from kvlab.errors import KvlabError
from kvlab.request import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig, Sequence


def test_slots_are_taken_once_and_given_back():
    slots = StateSlots(2)
    a = slots.allocate("a")
    assert slots.allocate("a") == a  # idempotent: one slot per sequence
    b = slots.allocate("b")
    assert {a, b} == {0, 1} and slots.num_free == 0
    assert not slots.can_allocate("c") and slots.can_allocate("a")
    with pytest.raises(ValueError, match="no free state slot"):
        slots.allocate("c")
    slots.free("a")
    slots.free("a")  # twice: nothing more
    assert slots.num_free == 1 and slots.slot("a") is None
    assert slots.allocate("c") == a and slots.slot("b") == b


def test_no_slots_is_refused():
    with pytest.raises(ValueError, match="need >= 1"):
        StateSlots(0)


def test_manager_takes_a_slot_with_the_first_blocks_and_frees_it_with_them():
    kv = KVCacheManager(num_blocks=16, block_size=4, state_slots=2)
    assert kv.allocate_slots("a", 5) and kv.allocate_slots("b", 3)
    assert {kv.state_slot("a"), kv.state_slot("b")} == {0, 1}
    free_blocks = kv.num_free_blocks
    assert not kv.allocate_slots("c", 2)  # blocks enough, but no slot: nothing taken
    assert kv.num_free_blocks == free_blocks and kv.state_slot("c") is None
    assert kv.allocate_slots("a", 9)  # growing keeps the same slot
    slot_a = kv.state_slot("a")
    kv.free("a")
    assert kv.state_slot("a") is None
    assert kv.allocate_slots("c", 2) and kv.state_slot("c") == slot_a


def test_without_recurrent_layers_there_are_no_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 4) and kv.state_slot("a") is None


def test_prefix_cache_is_off_with_state_slots():
    """A prefix hit would skip tokens whose recurrent state this sequence never computed."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True,
                        state_slots=2)
    assert not kv.enable_prefix_caching
    ids = list(range(12))
    assert kv.allocate_slots("a", len(ids))
    kv.cache_full_blocks("a", ids, len(ids))
    kv.free("a")
    assert kv.get_computed_blocks(ids) == ([], 0)


def _seq(seq_id: str, n: int) -> Sequence:
    return Sequence(seq_id, list(range(n)), n, SamplingParams(max_tokens=4))


def test_scheduler_admits_only_with_a_free_slot_and_carries_it():
    kv = KVCacheManager(num_blocks=64, block_size=4, state_slots=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    seqs = {s.seq_id: s for s in (_seq("a", 5), _seq("b", 6), _seq("c", 7))}
    for s in seqs.values():
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == ["a", "b"]  # "c" waits for a slot
    assert sorted(s.state_slot for s in out.scheduled) == [0, 1]
    sched.update(out, seqs)
    slot_a = kv.state_slot("a")
    sched.finish(seqs["a"])
    out = sched.schedule()
    c = next(s for s in out.scheduled if s.seq_id == "c")
    assert c.start == 0 and c.state_slot == slot_a


def test_preemption_gives_the_slot_back_and_recomputes_from_token_zero():
    kv = KVCacheManager(num_blocks=4, block_size=4, state_slots=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv)
    seqs = {"a": _seq("a", 8), "b": _seq("b", 8)}
    for s in seqs.values():
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 2
    sched.update(out, seqs)
    seqs["a"].token_ids.append(1)  # "a" grows into a third block: "b" is preempted
    out = sched.schedule()
    assert out.preempted == ["b"] and kv.state_slot("b") is None
    assert kv.states is not None and kv.states.num_free == 1
    sched.update(out, seqs)
    sched.finish(seqs["a"])
    out = sched.schedule()
    (b,) = out.scheduled
    assert b.seq_id == "b" and b.start == 0 and b.state_slot is not None


HYBRID = ModelConfig(
    architecture="lfm2", vocab_size=96, hidden_size=64, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=4096,
    layer_types=("recurrent", "full", "recurrent", "full"),
    recurrent=RecurrentConfig("short_conv", conv_kernel=3, conv_channels=64))


def test_config_counts_state_and_kv_of_their_own_layers():
    assert HYBRID.num_recurrent_layers == 2
    assert HYBRID.state_bytes_per_seq() == 4 * 2 * 2 * 64  # fp32, 2 layers, (K-1) x C
    assert HYBRID.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2  # the 2 attention layers
    delta = RecurrentConfig("gated_delta", 4, 96, num_k_heads=2, num_v_heads=4,
                            k_head_dim=8, v_head_dim=16)
    assert delta.recurrent_state_shape == (4, 8, 16)
    assert delta.state_elements == 3 * 96 + 4 * 8 * 16


def test_pool_sizes_pay_for_the_states_first():
    budget = CacheBudget(2, 16, 1 << 20, max_num_seqs=8, max_num_batched_tokens=256)
    pools = pool_sizes(HYBRID, budget, windowed=True)
    assert pools.state_slots == 8
    block = HYBRID.kv_bytes_per_token(2) * 16
    assert pools.num_blocks == int(((1 << 20) - 8 * HYBRID.state_bytes_per_seq()) / block)
    plain = dataclasses.replace(HYBRID, layer_types=(), recurrent=None)
    assert pool_sizes(plain, budget, windowed=True).state_slots == 0
    tiny = dataclasses.replace(budget, memory_bytes=8 * HYBRID.state_bytes_per_seq())
    with pytest.raises(KvlabError, match="recurrent states of 8 sequences"):
        pool_sizes(HYBRID, tiny, windowed=True)
