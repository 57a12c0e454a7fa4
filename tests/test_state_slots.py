"""State slots of hybrid models without a model: the slot table, the KV cache manager that
owns it, the scheduler's admission and preemption, and the pool sizing that pays for it."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.cache import KVCacheManager
from kvlab.cache.pool_sizes import CacheBudget, pool_sizes
from kvlab.cache.state_slots import SnapshotSpec, StateSlots, StateSnapshots
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


# ---- state snapshots: the prefix cache of a hybrid model ------------------------------------

def test_snapshot_boundaries_cut_steps():
    snaps = StateSnapshots(SnapshotSpec(num_rows=2, every_blocks=2), first_row=4, block_size=4)
    assert snaps.stride == 8
    assert snaps.cut(0, 25, 25) == 24  # the last boundary inside the step
    assert snaps.cut(0, 24, 24) == 24 and snaps.cut(24, 25, 25) == 25
    assert snaps.cut(3, 7, 30) == 7 and snaps.cut(5, 17, 30) == 16
    assert snaps.cut(3, 7, 7) == 4  # a 7-token prompt's last full block ends at 4
    assert snaps.cut(16, 17, 17) == 17


def test_a_step_is_also_cut_at_the_prompts_last_full_block():
    snaps = StateSnapshots(SnapshotSpec(num_rows=2, every_blocks=4), first_row=0, block_size=4)
    #  positions  0 ......... 16 ..... 20 .. 23      stride 16, a 23-token prompt
    #  boundary              ^ stride  ^ prompt's last full block
    assert snaps.cut(0, 23, 23) == 20 and snaps.cut(20, 23, 23) == 23
    assert snaps.cut(0, 18, 23) == 16 and snaps.cut(16, 23, 23) == 20
    assert snaps.cut(0, 20, 20) == 16  # a prompt of whole blocks ends on its boundary
    assert snaps.cut(20, 21, 20) == 21  # decode: one token at a time, never cut
    assert snaps.cut(0, 3, 3) == 3  # no full block in the prompt


def test_snapshot_rows_are_saved_committed_found_and_evicted():
    snaps = StateSnapshots(SnapshotSpec(num_rows=2, every_blocks=2), first_row=4, block_size=4)
    assert snaps.reserve("a", 7, 30) is None  # not a boundary
    assert snaps.reserve("a", 4, 30) is None  # a block boundary, but no snapshot boundary
    row = snaps.reserve("a", 8, 30)
    assert row == 4 and snaps.reserve("a", 8, 30) == 4 and snaps.saving("a", 8) == 4
    snaps.commit("a", links=[101, 102], num_full=2)  # block 1 registered as content 102
    assert snaps.saving("a", 8) is None
    assert snaps.usable([101, 102, 103]) == 2 and snaps.usable([101, 999]) == 0
    assert snaps.restore("b", 102) == 4 and snaps.restoring("b") == 4
    assert snaps.reserve("c", 16, 30) == 5
    assert snaps.reserve("d", 8, 30) is None  # row 4 is pinned by "b"'s restore, 5 is "c"'s
    snaps.commit("b", links=[], num_full=0)  # "b" ran its first step: unpinned
    assert snaps.restoring("b") is None
    assert snaps.reserve("d", 8, 30) == 4  # the least recently used snapshot gives its row
    assert snaps.usable([101, 102]) == 0
    snaps.release("c", [])
    snaps.release("d", [])
    assert snaps.reserve("e", 8, 30) in (4, 5)


def test_a_snapshot_whose_block_was_not_registered_gives_its_row_back():
    snaps = StateSnapshots(SnapshotSpec(num_rows=1, every_blocks=1), first_row=0, block_size=4)
    assert snaps.reserve("a", 8, 30) == 0
    snaps.commit("a", links=[7], num_full=2)  # block 1 collided: only block 0 registered
    assert snaps.usable([7, 8]) == 0 and snaps.reserve("b", 4, 30) == 0


def test_the_prompt_end_is_a_snapshot_and_decode_keeps_one_tail_row():
    snaps = StateSnapshots(SnapshotSpec(num_rows=3, every_blocks=4), first_row=2, block_size=4)
    links = [100 + i for i in range(8)]
    assert snaps.reserve("a", 20, 23) == 2  # the 23-token prompt's last full block (block 4)
    snaps.commit("a", links[:5], num_full=5)
    assert snaps.usable(links[:6]) == 5
    assert snaps.reserve("a", 23, 23) is None and snaps.reserve("a", 24, 23) == 3  # tail
    snaps.commit("a", links[:6], num_full=6)
    assert snaps.usable(links[:7]) == 5  # the tail is the sequence's until it is released
    assert snaps.reserve("a", 28, 23) == 3 and snaps.saving("a", 28) == 3  # overwritten
    assert snaps.saving("a", 24) is None and snaps.num_used == 2
    snaps.commit("a", links[:7], num_full=7)
    snaps.release("a", links[:7])
    assert snaps.usable(links[:8]) == 7 and snaps.num_saved == 2 and snaps.num_used == 2


def test_a_tail_is_kept_only_for_a_registered_block_and_skipped_without_a_row():
    snaps = StateSnapshots(SnapshotSpec(num_rows=1, every_blocks=4), first_row=0, block_size=4)
    assert snaps.reserve("a", 8, 5) == 0
    snaps.release("a", [11])  # gone before block 1 was registered: the row comes back
    assert snaps.num_used == 0 and snaps.usable([11, 12]) == 0
    assert snaps.reserve("b", 8, 5) == 0 and snaps.reserve("c", 8, 5) is None  # none free
    snaps.release("c", [11, 12])
    snaps.release("b", [21, 22])
    assert snaps.usable([21, 22]) == 2 and snaps.num_used == 1


def test_manager_resumes_a_prefix_hit_from_the_deepest_snapshot():
    kv = KVCacheManager(num_blocks=32, block_size=4, state_slots=2,
                        snapshots=SnapshotSpec(num_rows=2, every_blocks=2))
    assert kv.enable_prefix_caching
    ids = list(range(30))
    assert kv.step_end(0, 18, 25) == 16
    assert kv.allocate_slots("a", 16)  # a first chunk ends at 16: its state saved in row 2
    assert kv.state_copies("a", 16, 25) == (None, 2)  # (the rows after the 2 slots')
    kv.cache_full_blocks("a", ids[:25], 16)
    assert kv.allocate_slots("a", 24)
    assert kv.state_copies("a", 24, 25) == (None, 3)
    kv.cache_full_blocks("a", ids[:25], 24)
    kv.free("a")
    blocks, n = kv.get_computed_blocks(ids[:25])
    assert n == 24 and len(blocks) == 6
    _, n = kv.get_computed_blocks(ids[:21] + [99] * 4)  # shares 5 blocks: resumes after 4
    assert n == 16
    _, n = kv.get_computed_blocks(ids[:13])  # shares 3 blocks: none ends on a snapshot
    assert n == 0
    assert kv.allocate_slots("b", 25, blocks)
    assert kv.state_copies("b", 25, 25) == (3, None)


def test_manager_registers_a_finished_sequences_tail_under_its_deepest_block():
    kv = KVCacheManager(num_blocks=16, block_size=4, state_slots=1,
                        snapshots=SnapshotSpec(num_rows=2, every_blocks=16))
    ids = list(range(40))
    assert kv.step_end(0, 10, 10) == 8  # the 10-token prompt's last full block
    assert kv.allocate_slots("a", 8) and kv.state_copies("a", 8, 10) == (None, 1)
    kv.cache_full_blocks("a", ids[:10], 8)
    for done in range(8, 17):  # the rest of the prompt, then decode to 17 computed tokens
        assert kv.allocate_slots("a", done + 1)
        assert kv.state_copies("a", done + 1, 10)[1] == (2 if (done + 1) % 4 == 0 else None)
        kv.cache_full_blocks("a", ids[:done + 2], done + 1)
    kv.free("a")
    assert kv.get_computed_blocks(ids[:20])[1] == 16  # the tail, after block 3
    assert kv.get_computed_blocks(ids[:14])[1] == 8  # the prompt's snapshot, after block 1
    assert kv.num_free_blocks == kv.num_blocks and kv.states.num_free == 1
    assert kv.snapshots.num_used == kv.snapshots.num_saved == 2


def test_a_hybrid_without_snapshots_has_no_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, state_slots=1)
    assert not kv.enable_prefix_caching and kv.snapshots is None
    assert kv.step_end(0, 25, 25) == 25 and kv.state_copies("a", 8, 25) == (None, None)
