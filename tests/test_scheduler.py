"""Scheduler bookkeeping without a model: token budgets, chunk boundaries, preemption order."""

from __future__ import annotations

from kvlab.cache import KVCacheManager
from kvlab.request import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence

P = SamplingParams(max_tokens=4, temperature=0)


def make(num_blocks=16, block_size=4, max_seqs=8, budget=16, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv)


def seq(sid: str, n: int, first: int = 0) -> Sequence:
    ids = list(range(first, first + n))
    return Sequence(sid, ids, len(ids), P)


def run_step(s: Scheduler, sample: int = 7):
    out = s.schedule()
    seqs = {x.seq_id: x for x in list(s.running) + list(s.waiting)}
    s.update(out, seqs)
    for x in out.scheduled:
        if x.needs_logits:
            seqs[x.seq_id].token_ids.append(sample)
    return out


def test_chunked_prefill_boundaries():
    s = make(budget=5)
    a = seq("a", 12)
    s.add(a)
    chunks = [(x.start, len(x.token_ids), x.needs_logits) for x in run_step(s).scheduled]
    chunks += [(x.start, len(x.token_ids), x.needs_logits) for x in run_step(s).scheduled]
    chunks += [(x.start, len(x.token_ids), x.needs_logits) for x in run_step(s).scheduled]
    assert chunks == [(0, 5, False), (5, 5, False), (10, 2, True)]
    assert a.num_computed_tokens == 12 and a.num_tokens == 13
    nxt = run_step(s).scheduled
    assert [(x.start, len(x.token_ids), x.prefill_tokens) for x in nxt] == [(12, 1, 0)]


def test_running_decode_goes_before_waiting_prefill():
    s = make(budget=6)
    s.add(seq("a", 3))
    run_step(s)
    s.add(seq("b", 10, first=100))
    out = run_step(s)
    assert [(x.seq_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 5)]


def test_max_num_seqs_caps_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(seq(str(i), 2, first=10 * i))
    out = run_step(s)
    assert [x.seq_id for x in out.scheduled] == ["0", "1"]
    assert [x.seq_id for x in s.waiting] == ["2"]


def test_preempts_newest_when_blocks_run_out():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 8), seq("b", 7, first=50)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 9 tokens (3 blocks needed next), b: 8 tokens (2 blocks) -> 4 blocks used
    out = run_step(s)  # a needs a third block: b, the newest, gives its blocks back
    assert out.preempted == ["b"]
    assert b.status == SeqStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.waiting[0] is b
    assert [x.seq_id for x in out.scheduled] == ["a"]


def test_prefix_hit_skips_cached_blocks_but_not_the_last_token():
    s = make(block_size=4)
    a = seq("a", 10)
    s.add(a)
    run_step(s)
    b = seq("b", 10)  # same 10 tokens
    s.add(b)
    out = run_step(s)
    sched_b = next(x for x in out.scheduled if x.seq_id == "b")
    assert sched_b.start == 8 and b.num_cached_tokens == 8
    c = seq("c", 8)  # exactly two full blocks: the last block must still be computed
    s.add(c)
    sched_c = next(x for x in run_step(s).scheduled if x.seq_id == "c")
    assert sched_c.start == 4 and sched_c.needs_logits


def test_finish_frees_blocks():
    s = make()
    a = seq("a", 9)
    s.add(a)
    run_step(s)
    s.finish(a)
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_unfinished()
