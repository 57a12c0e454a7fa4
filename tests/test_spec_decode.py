"""Speculative decoding (kvlab.spec): prompt-lookup proposals, the scheduler's catch-up and
truncation, the adaptive sizing, and exactness: greedy text identical to decoding without
speculation (tiny random models and the default model, alone, batched, chunked, preempted),
sampled tokens distributed as without it (a chi-square test over seeded draws)."""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from test_server import MODEL, start_server

from kvlab.cache import KVCacheManager
from kvlab.cli.common import speculative_config
from kvlab.engine import Engine, EngineConfig
from kvlab.errors import KvlabError
from kvlab.request import FinishReason, SamplingParams, Structure
from kvlab.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from kvlab.server.core.prom import speculative_lines
from kvlab.spec.adaptive import (
    EXPLORE_EVERY,
    Acceptance,
    DraftCost,
    DraftState,
    Planner,
    StepCost,
)
from kvlab.spec.draft import CATCH_UP_EVERY
from kvlab.spec.ngram import NgramIndex
from kvlab.spec.proposer import Candidate, NgramProposer
from kvlab.spec.stats import SpecCounts
from kvlab.spec.verify import judge

from tiny_models import build

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SPEC = {"speculative": "ngram", "num_speculative": 4, "speculative_adaptive": False}


# ---- the proposer ---------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    # the longest suffix wins: (5, 1) occurred before 7, (1,) last before 8
    assert NgramIndex().propose([5, 1, 7, 1, 8, 5, 1], 2) == [7, 1]
    # a proposal stops where the sequence ends
    assert NgramIndex().propose([4, 6, 4], 5) == [6, 4]


def test_ngram_never_matches_its_own_suffix_and_grows_incrementally():
    index = NgramIndex()
    assert index.propose([1, 2, 3], 4) == []
    tokens = [1, 2, 3, 1]
    assert index.propose(tokens, 4) == [2, 3, 1]
    tokens += [2, 3, 7, 1]
    assert index.propose(tokens, 2) == [2, 3]
    assert index.num_indexed == len(tokens)
    assert index.propose(tokens, 0) == []


def test_ngram_index_matches_a_brute_force_search():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    index = NgramIndex(1, 3)
    for end in range(1, len(tokens)):
        seen = tokens[:end]
        want = []
        for n in range(min(3, end), 0, -1):
            starts = [j for j in range(end - n) if seen[j:j + n] == seen[end - n:]]
            if starts:
                j = starts[-1] + n
                want = seen[j:j + 3]
                break
        assert index.propose(seen, 3) == want, end


# ---- sizing ---------------------------------------------------------------------------------

def test_acceptance_falls_on_rejections_and_counts_trials_to_the_first_one():
    a = Acceptance()
    a.record(4, 0)  # one trial: the first proposal failed
    assert a.rate < 0.5
    low = a.rate
    a.record(4, 4)
    assert a.rate > low
    assert Acceptance(prior=1.0).expected(3) == 3.0


def test_planner_speculates_while_rows_are_cheap_and_not_when_compute_bound():
    planner = Planner(4)
    for _ in range(50):  # memory-bound: rows cost little beside the weight pass
        planner.cost.observe(1, False, 0.010)
        planner.cost.observe(5, True, 0.0105)
    good = DraftState(acceptance=Acceptance(prior=0.8))
    assert planner.plan([good], [4], 1) == [4]
    bound = Planner(4)
    for _ in range(50):  # compute-bound: each row costs as much as the fixed pass
        bound.cost.observe(8, False, 0.080)
        bound.cost.observe(16, True, 0.160)
    assert bound.plan([good] * 8, [4] * 8, 8) == [0] * 8


def test_k_shrinks_to_zero_on_failures_and_grows_back_through_shadow_trials():
    planner = Planner(4)
    for _ in range(50):  # fixed 9 ms, 1 ms a row, 5 ms for the several-token path
        planner.cost.observe(1, False, 0.010)
        planner.cost.observe(3, True, 0.017)
        planner.cost.observe(5, True, 0.019)
    state = DraftState()
    for _ in range(10):
        state.acceptance.record(4, 0)
    assert planner.plan([state], [4], 1) == [0]
    proposer = NgramProposer(4)
    proposer.planner = planner
    tokens = [1, 2, 3, 4, 5, 6] * 3
    made = []
    for _ in range(30):  # the text repeats: each unmade proposal would have been right
        proposed = proposer.propose([_candidate(state, tokens)], 1)[0]
        state.acceptance.record(len(proposed), len(proposed))  # all right: the text repeats
        made += proposed
        tokens.append(tokens[-6])
    assert made  # proposals came back once the shadow trials had raised the rate
    assert state.acceptance.rate > 0.8


def test_planner_probes_one_proposal_after_declining_many_steps():
    planner = Planner(2)
    for _ in range(50):
        planner.cost.observe(1, False, 0.010)
        planner.cost.observe(3, True, 0.040)
    state = DraftState(acceptance=Acceptance(prior=0.3))
    plans = [planner.plan([state], [2], 1) for _ in range(EXPLORE_EVERY + 1)]
    assert plans[:EXPLORE_EVERY] == [[0]] * EXPLORE_EVERY
    assert plans[-1] == [1]  # the likeliest one token: its cost is measured again


def test_step_cost_fit_recovers_its_terms():
    cost = StepCost()
    assert cost.seconds(4, True) == cost.seconds(1, False)  # before any step: all alike
    for _ in range(5):
        for rows in range(1, 9):
            for multi in (False, True):
                cost.observe(rows, multi, 0.01 + 0.002 * rows + 0.003 * multi)
    assert cost.seconds(4, True) == pytest.approx(0.021, rel=0.02)
    assert cost.seconds(4, False) == pytest.approx(0.018, rel=0.02)


def test_draft_cost_fit_recovers_its_terms():
    cost = DraftCost()
    for _ in range(5):
        for rows in (1, 2, 9, 40):
            cost.observe(rows, 0.0015 + 0.0001 * rows)
    assert cost.seconds(3, 4) == pytest.approx(3 * 0.0015 + 4 * 0.0001, rel=0.02)


def _simulate_draft(rate: float, steps: int = 300) -> list[int]:
    """A draft proposer's plans for one sequence over `steps` decode steps: the target takes
    10 ms + 0.2 ms a row (+ 0.5 ms with proposals), a draft pass 1.5 ms (0.15 of it) + 0.1
    ms a row; each draft token matches the target's with probability `rate`; a declined
    step's token is a shadow trial, its draft catching up every CATCH_UP_EVERY tokens."""
    state = DraftState(acceptance=Acceptance())
    planner, rng = Planner(4, draft=True), random.Random(0)
    plans, behind = [], 0
    for _ in range(steps):
        k = planner.plan([state], [4], 1)[0]
        plans.append(k)
        if k:
            for _ in range(k):
                planner.draft_cost.observe(1, 0.0015 + 0.0001)
            accepted = 0
            while accepted < k and rng.random() < rate:
                accepted += 1
            state.acceptance.record(k, accepted)
            behind = 0
        else:
            state.acceptance.record(1, int(rng.random() < rate))
            behind += 1
            if behind == CATCH_UP_EVERY:
                planner.draft_cost.observe(behind, 0.0015 + 0.0001 * behind)
                behind = 0
        planner.cost.observe(1 + k, k > 0, 0.010 + 0.0002 * (1 + k) + 0.0005 * (k > 0))
    return plans


def test_a_draft_that_agrees_proposes_several_and_one_that_disagrees_none():
    assert min(_simulate_draft(0.8)[100:]) >= 2
    late = _simulate_draft(0.1)[100:]
    assert sum(1 for k in late if k) <= len(late) // EXPLORE_EVERY + 1  # exploring only


def test_the_step_fit_sees_the_step_without_the_draft_passes(tiny):
    e = engine(tiny, speculative="draft", draft_model=str(tiny))
    proposer = e.scheduler.proposer
    target = StepCost()  # what the fit is, timing the target's part alone
    proposer.drafting = 0.004  # as after a propose that spent 4 ms in draft passes
    proposer.observe_step(3, True, 0.010)
    target.observe(3, True, 0.006)
    proposer.observe_step(1, False, 0.005)  # drafting counts once
    target.observe(1, False, 0.005)
    for rows, multi in ((1, False), (3, True), (5, True)):
        assert proposer.planner.cost.seconds(rows, multi) == target.seconds(rows, multi)


def _candidate(state, tokens, cap=4):
    return Candidate(state, tokens, cap)


# ---- the scheduler's catch-up ---------------------------------------------------------------

def _scheduler(budget=64, blocks=32, prefix=True):
    kv = KVCacheManager(blocks, 4, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(4, budget), kv, NgramProposer(4, adaptive=False)), kv


def _decoding(sched, tokens, n_prompt, max_tokens=32):
    """A sequence whose tokens but the last are computed, as after a decode step."""
    seq = Sequence("s", list(tokens), n_prompt, SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    out = sched.schedule()  # its prefill
    seq.num_computed_tokens = len(tokens)
    sched.update(out, {"s": seq})
    seq.token_ids.append(tokens[0])  # a sampled token, not computed yet
    return seq


def test_proposals_are_tokens_not_yet_computed_with_a_logits_row_each():
    sched, kv = _scheduler()
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7], 7)  # ends 7 1: 1 was followed by 2 3 4 5
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [1, 2, 3, 4, 5] and s.start == 7
    assert s.needs_logits and s.num_logits == 5 and seq.num_draft_tokens == 4
    assert len(kv.block_table("s")) == 3  # 12 positions


def test_settle_drops_rejected_proposals_and_releases_their_blocks():
    sched, kv = _scheduler()
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7], 7)
    out = sched.schedule()
    free = kv.num_free_blocks
    sched.settle(seq, 1)  # 2 kept; 3 4 5 rejected
    sched.update(out, {"s": seq})
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert seq.num_computed_tokens == 9 and seq.num_draft_tokens == 0
    assert len(kv.block_table("s")) == 3 and kv.num_free_blocks == free
    sched.settle(seq, 0)  # nothing proposed: nothing changes
    seq.token_ids.append(9)
    assert sched.schedule().scheduled[0].token_ids[0] == 9


def test_the_prefix_cache_never_registers_an_unverified_token():
    sched, kv = _scheduler()
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7], 7)
    out = sched.schedule()  # positions 7..11: block 1 (4..7) and block 2 (8..11)
    sched.settle(seq, 0)  # every proposal rejected
    sched.update(out, {"s": seq})
    assert len(kv.block_table("s")) == 2
    # block 1 holds 5 6 7 1, all verified; no block holding a proposal was registered
    blocks, hit = kv.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 0])
    assert hit == 8 and blocks == kv.block_table("s")[:2]


def test_proposals_past_the_token_budget_or_max_tokens_are_dropped():
    sched, _ = _scheduler(budget=3)
    _decoding(sched, [1, 2], 2)
    seq = sched.running[0]
    seq.token_ids[:] = [1, 2, 3, 4, 5, 6, 7, 1]
    seq.num_computed_tokens = 7
    (s,) = sched.schedule().scheduled
    assert s.token_ids == [1, 2, 3] and s.num_logits == 3 and seq.num_tokens == 10
    sched2, _ = _scheduler()
    seq2 = _decoding(sched2, [1, 2, 3, 4, 5, 6, 7], 7, max_tokens=3)
    (s2,) = sched2.schedule().scheduled
    # one output so far, one proposed: the token drawn after it is the third and last
    assert s2.token_ids == [1, 2] and len(seq2.output_ids) == 2


def test_preemption_drops_proposals():
    sched, kv = _scheduler(blocks=3, prefix=False)
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7], 7)
    out = sched.schedule()  # 12 positions: all 3 blocks, proposals trimmed to fit
    assert out.scheduled and seq.num_tokens <= 12
    sched._preempt(sched.running.pop())
    assert seq.num_draft_tokens == 0 and seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 1]


# ---- verification -------------------------------------------------------------------------

def test_judge_greedy_accepts_exactly_the_argmax():
    probs = torch.tensor([0.0, 0.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    assert judge(probs, 2, True, gen) == (2, True)
    assert judge(probs, 1, True, gen) == (2, False)
    assert judge(probs, None, True, gen) == (2, False)


def test_judge_matches_the_target_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(1)
    draws = [judge(probs, 1, False, gen)[0] for _ in range(6000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert chi_square([int(f * 6000) for f in freq], probs.tolist()) < chi2_critical(2)
    assert freq[3] == 0


Z_999 = 3.0902  # the standard normal's 0.999 quantile


def chi2_critical(dof: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 3 % of
    scipy.stats.chi2.ppf(0.999, dof) from 2 degrees of freedom on: 13.82 at 2, 29.59 at 10,
    42.31 at 18)."""
    h = 2 / (9 * dof)
    return dof * (1 - h + Z_999 * h ** 0.5) ** 3


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """Homogeneity of two count vectors over the same categories: (statistic, dof), with
    categories under 5 expected counts pooled into one."""
    na, nb = sum(a), sum(b)
    big = [i for i in range(len(a)) if (a[i] + b[i]) * min(na, nb) / (na + nb) >= 5]
    rest = [i for i in range(len(a)) if i not in big]
    cols = [(a[i], b[i]) for i in big]
    if rest:
        cols.append((sum(a[i] for i in rest), sum(b[i] for i in rest)))
    stat = 0.0
    for ca, cb in cols:
        total = ca + cb
        for c, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (c - expected) ** 2 / expected if expected else 0.0
    return stat, len(cols) - 1


# ---- the engine on tiny random models -----------------------------------------------------

@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    build(request.param, out)
    return out / "model.gguf"


def engine(path, **kw) -> Engine:
    return Engine.from_model(str(path), EngineConfig(**{"block_size": 4, **kw}))


def run_all(e: Engine, prompts, params=GREEDY) -> list[list[int]]:
    return [o[0] for o in outputs(e, prompts, params)]


def outputs(e: Engine, prompts, params=GREEDY):
    """Per prompt: (token ids, logprobs, finish reason, text)."""
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    got = {str(i): ([], [], None, "") for i in range(len(prompts))}
    while e.has_unfinished():
        for out in e.step():
            ids, lps, _, text = got[out.request_id]
            got[out.request_id] = (ids + out.new_token_ids, lps + out.logprobs,
                                   out.finish_reason, text + out.text_delta)
    return [got[str(i)] for i in range(len(prompts))]


PROMPTS = [[3, 14, 15, 92, 65, 3, 14, 15], list(range(20, 57)) * 2, [7] * 9,
           [5, 6, 7, 8] * 6, list(range(60, 90))]


@pytest.fixture(scope="module")
def alone(tiny):
    return [run_all(engine(tiny), [p])[0] for p in PROMPTS]


def test_greedy_alone_and_batched_equal_plain_decoding(tiny, alone):
    e = engine(tiny, **SPEC)
    assert [run_all(e, [p])[0] for p in PROMPTS] == alone
    assert run_all(e, PROMPTS) == alone
    counts = e.stats().speculative
    assert counts.drafted > counts.accepted > 0  # some proposals kept, some rejected


def test_greedy_chunked_and_preempted_equal_plain_decoding(tiny, alone):
    assert run_all(engine(tiny, max_num_batched_tokens=6, **SPEC), PROMPTS) == alone
    per_token = engine(tiny, kv_dtype="f32").cost.kv_bytes_per_token
    # room for 120 tokens: the requests need 285 (the longest 98), so some are preempted
    small = engine(tiny, kv_dtype="f32", kv_cache_gib=120 * per_token / 2**30, **SPEC)
    for i, p in enumerate(PROMPTS):
        small.add_request(str(i), p, GREEDY)
    seqs = [small.requests[str(i)].seq for i in range(len(PROMPTS))]
    while small.has_unfinished():
        small.step()
    assert [s.output_ids for s in seqs] == alone
    assert any(s.num_preemptions for s in seqs)
    assert small.kv.num_free_blocks == small.kv.num_blocks


def test_greedy_with_penalties_equals_plain_decoding(tiny):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.5,
                            logit_bias={7: 2.0})
    assert run_all(engine(tiny, **SPEC), PROMPTS, params) == run_all(engine(tiny), PROMPTS,
                                                                     params)


def test_logprobs_of_accepted_tokens_come_from_the_model(tiny):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    plain = outputs(engine(tiny), PROMPTS, params)
    spec = outputs(engine(tiny, **SPEC), PROMPTS, params)
    for (ids, lps, _, _), (ids2, lps2, _, _) in zip(plain, spec):
        assert ids == ids2 and [lp.token_id for lp in lps2] == ids
        for a, b in zip(lps, lps2):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-3)
            assert [t for t, _ in b.top] == [t for t, _ in a.top]


def test_max_tokens_and_stops_cut_an_accepted_run(tiny, alone):
    e = engine(tiny, **SPEC)
    for n in (1, 2, 5, 7):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        got = outputs(e, PROMPTS, params)
        assert [g[0] for g in got] == [a[:n] for a in alone]
        assert all(g[2] == FinishReason.LENGTH for g in got)
    stop_id = alone[3][5]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            stop_token_ids=(stop_id,))
    want = alone[3][:alone[3].index(stop_id) + 1]
    assert outputs(e, [PROMPTS[3]], params)[0][:3] == (want, [], FinishReason.STOP)
    text = outputs(engine(tiny), [PROMPTS[3]])[0][3]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    assert outputs(e, [PROMPTS[3]], params)[0][2:] == outputs(engine(tiny), [PROMPTS[3]],
                                                              params)[0][2:]
    assert not e.requests and e.kv.num_free_blocks == e.kv.num_blocks


def test_structured_output_checks_proposals(tiny):
    params = SamplingParams(max_tokens=24, temperature=0,
                            structured=Structure("regex", "(ab|cd)+x"))
    prompts = ["abcdabcdab", "cdcdcdcdxab", "abab"]
    plain = outputs(engine(tiny), prompts, params)
    e = engine(tiny, **SPEC)
    spec = outputs(e, prompts, params)
    assert [s[:3] for s in spec] == [p[:3] for p in plain]
    assert e.stats().speculative.drafted > 0
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=5,
                             structured=Structure("regex", "(ab|cd)+x"))
    for _, _, reason, text in outputs(e, prompts * 3, sampled):
        assert re.fullmatch("(ab|cd)+x", text) or reason == FinishReason.LENGTH, text


def test_abort_mid_speculation_frees_everything(tiny):
    e = engine(tiny, **SPEC)
    e.add_request("a", PROMPTS[3], GREEDY)
    e.add_request("b", PROMPTS[1], GREEDY)
    for _ in range(4):
        e.step()
    e.abort("a")
    while e.has_unfinished():
        e.step()
    e.abort("b")
    assert e.kv.num_free_blocks == e.kv.num_blocks and not e.scheduler.running


def test_sampled_tokens_are_distributed_as_without_speculation(tiny):
    """Token frequencies at each of the first positions after the prompt, over many seeded
    draws, with and without speculation (temperature, top-k, top-p and a penalty)."""
    params = {"max_tokens": 4, "temperature": 0.8, "top_k": 6, "top_p": 0.95,
              "presence_penalty": 0.4, "ignore_eos": True}
    seed = [5, 6, 7, 8] * 3  # then its greedy continuation and itself again: the lookup
    prompt = seed + run_all(engine(tiny), [seed])[0][:12] + seed  # proposes likely tokens
    draws = 500
    counts = {}
    for name, kw in (("plain", {}), ("spec", SPEC)):
        e = engine(tiny, max_num_seqs=32, **kw)
        got = _seeded(e, prompt, params, draws)
        counts[name] = [torch.bincount(torch.tensor([g[i] for g in got]), minlength=96).tolist()
                        for i in range(4)]
        if kw:
            assert e.stats().speculative.drafted > e.stats().speculative.accepted > 0
    for pos in range(4):
        stat, dof = two_sample_chi_square(counts["plain"][pos], counts["spec"][pos])
        assert stat < chi2_critical(dof), (pos, stat, dof)


def _seeded(e: Engine, prompt, params, n) -> list[list[int]]:
    for i in range(n):
        e.add_request(str(i), prompt, SamplingParams(**params, seed=1000 + i))
    got: dict[str, list[int]] = {str(i): [] for i in range(n)}
    while e.has_unfinished():
        for out in e.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[str(i)] for i in range(n)]


# ---- the default model --------------------------------------------------------------------

CODE = ("def parse_header(line):\n    key, _, value = line.partition(':')\n"
        "    return key.strip().lower(), value.strip()\n")
DEFAULT_PROMPTS = [
    "Rewrite this function with parse_header renamed to split_header:\n" + CODE + "\n",
    ("Fix the typo in this paragraph: The quick brown fox jumsp over the lazy dog. "
     "The dog sleeps all day.\nFixed: The quick"),
    'Continue the list: ["apple", "banana", "cherry", "apple", "banana",',
    "The capital of France is",
]


@pytest.fixture(scope="module")
def default_engines(default_model_path):
    return engine(default_model_path, threads=2), engine(default_model_path, threads=2,
                                                         speculative="ngram")


def test_default_model_greedy_text_is_identical(default_engines):
    plain, spec = default_engines
    params = SamplingParams(max_tokens=40, temperature=0)
    alone = [outputs(plain, [p], params)[0] for p in DEFAULT_PROMPTS]
    assert [outputs(spec, [p], params)[0][::2] for p in DEFAULT_PROMPTS] == [
        a[::2] for a in alone]
    assert [o[::2] for o in outputs(spec, DEFAULT_PROMPTS, params)] == [a[::2] for a in alone]
    assert spec.stats().speculative.accepted > 0


# ---- flags and reporting ----------------------------------------------------------------

@pytest.mark.slow
def test_serve_reports_proposals_in_usage_and_metrics(tmp_path):
    """`kvlab serve --speculative ngram`: the OpenAI client's usage counts accepted and
    rejected proposals; /metrics has the counters and the acceptance-length histogram."""
    with start_server(tmp_path / "serve.log", "--speculative", "ngram",
                      "--num-speculative", "3") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=48,
            messages=[{"role": "user", "content": DEFAULT_PROMPTS[0]}])
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens >= 0
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    drafted = _metric(metrics, "kvlab:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "kvlab:spec_decode_num_accepted_tokens_total")
    assert accepted == details.accepted_prediction_tokens
    assert drafted == accepted + details.rejected_prediction_tokens
    assert _metric(metrics, "kvlab:spec_decode_acceptance_length_count") == _metric(
        metrics, "kvlab:spec_decode_num_drafts_total") > 0


def _metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_speculative_flags_are_checked():
    with pytest.raises(KvlabError, match="--speculative 'medusa' is not a method"):
        EngineConfig(speculative="medusa")
    with pytest.raises(KvlabError, match="--num-speculative 0"):
        EngineConfig(speculative="ngram", num_speculative=0)
    with pytest.raises(KvlabError, match="--draft-model goes with --speculative draft"):
        EngineConfig(speculative="draft")
    with pytest.raises(KvlabError, match="--draft-model goes with --speculative draft"):
        EngineConfig(speculative="ngram", draft_model="x.gguf")
    args = argparse.Namespace(speculative=None, num_speculative=3, draft_model=None,
                              speculative_adaptive=None)
    with pytest.raises(KvlabError, match="--num-speculative applies with --speculative"):
        speculative_config(args)
    args = argparse.Namespace(speculative=None, num_speculative=None, draft_model=None,
                              speculative_adaptive="off")
    with pytest.raises(KvlabError, match="--speculative-adaptive applies with --speculative"):
        speculative_config(args)
    args = argparse.Namespace(speculative="ngram", num_speculative=None, draft_model=None,
                              speculative_adaptive=None)
    assert speculative_config(args) == {"speculative": "ngram", "num_speculative": 4,
                                        "draft_model": None, "speculative_adaptive": True}
    args = argparse.Namespace(speculative="draft", num_speculative=2, draft_model="d.gguf",
                              speculative_adaptive="off")
    assert speculative_config(args) == {"speculative": "draft", "num_speculative": 2,
                                        "draft_model": "d.gguf", "speculative_adaptive": False}


def _kvlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli.main", *args], check=False,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_run_json_and_bench_report_proposals():
    prompt = "Repeat exactly: red green blue red green blue red green blue"
    proc = _kvlab("run", "-n", "24", "--threads", "2", "--json", "--speculative", "ngram",
                  prompt)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)["speculative"]
    assert record["drafted_tokens"] >= record["accepted_tokens"] > 0
    proc = _kvlab("bench", "-p", "16", "-n", "16", "-r", "1", "--threads", "2",
                  "--speculative", "ngram", "--num-speculative", "3")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"tg16: speculative ngram \(up to 3 per step\): \d+ of \d+ proposed "
                     r"tokens accepted, acceptance rate [\d.]+ %", proc.stdout), proc.stdout


# ---- the verify rows ----------------------------------------------------------------------

@pytest.mark.parametrize("on_default", [False, True])
def test_verify_rows_equal_decoding_one_token_at_a_time(on_default, tiny, default_model_path):
    """A step's rows for a sequence with proposals are the logits decoding those tokens one
    step at a time gives (causal among them), bit for bit on the default model (the C
    one-call decode takes the step)."""
    e = engine(default_model_path if on_default else tiny, threads=2)
    ids = e.tokenizer.encode("one two three four five six seven") if on_default else PROMPTS[3]
    ids = ids + run_all(e, [ids], SamplingParams(max_tokens=6, temperature=0))[0]
    n = len(ids) - 6
    want = e.teacher_forced_logprobs(ids, n)[1:]  # decode rows at positions n .. len-1
    # as a verify step: the same prefill, then ids[n:] at once (a sampled token and five
    # proposed), a row at each
    for start, chunk, rows in ((0, ids[:n], 1), (n, ids[n:], 6)):
        assert e.kv.allocate_slots("v", start + len(chunk))
        step = SchedulerOutput([ScheduledSeq(
            "v", start, chunk, e.kv.block_table("v"), True, 0, e.kv.window_table("v"),
            num_logits=rows)])
        got = e.runner.execute(step).logits
    e.kv.free("v")
    got = torch.log_softmax(got, dim=-1)
    if on_default:  # the C kernels compute each row alone: the same bits
        assert torch.equal(got, want)
    else:  # torch's fp32 products round by the batch's row count
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_metrics_render_counters_and_acceptance_lengths():
    counts = SpecCounts()
    for proposed, accepted in ((4, 2), (4, 4), (3, 0), (20, 9)):
        counts.record(proposed, accepted)
    assert counts.acceptance_rate == 15 / 31
    text = "\n".join(speculative_lines(counts, {"model_name": "m"}))
    assert _metric(text, "kvlab:spec_decode_num_draft_tokens_total") == 31
    assert _metric(text, "kvlab:spec_decode_num_accepted_tokens_total") == 15
    assert _metric(text, "kvlab:spec_decode_num_drafts_total") == 4
    buckets = dict(re.findall(r'acceptance_length_bucket\{model_name="m",le="([^"]+)"\} (\d+)',
                              text))
    assert (buckets["0.0"], buckets["2.0"], buckets["4.0"], buckets["12.0"],
            buckets["+Inf"]) == ("1", "2", "3", "4", "4")
    assert _metric(text, "kvlab:spec_decode_acceptance_length_sum") == 15


# ---- a draft model ------------------------------------------------------------------------

def test_draft_model_proposals_keep_greedy_text(tiny, alone, tmp_path):
    """The target as its own draft: every proposal kept; another random model of the same
    vocabulary: most rejected; the text is plain decoding's either way, and the draft's
    cache is empty once the requests are done."""
    other = tmp_path / "other"
    build("gemma3", other, seed=1)
    for draft, all_kept in ((tiny, True), (other / "model.gguf", False)):
        e = engine(tiny, speculative="draft", draft_model=str(draft),
                   speculative_adaptive=False)
        assert run_all(e, PROMPTS) == alone
        assert [run_all(e, [p])[0] for p in PROMPTS[:2]] == alone[:2]
        counts = e.stats().speculative
        assert counts.drafted > 0 and (counts.accepted == counts.drafted) == all_kept
        draft_kv = e.scheduler.proposer.kv
        assert draft_kv.num_free_blocks == draft_kv.num_blocks


def test_adaptive_draft_proposals_and_catch_ups_keep_greedy_text(tiny, alone, tmp_path):
    """Sized by the planner, a disagreeing draft mostly catches up (rows scored at once,
    beside others' proposals in the same pass) instead of proposing: the text stays plain
    decoding's, batched or alone, and its cache is empty once the requests are done."""
    other = tmp_path / "other"
    build("gemma3", other, seed=1)
    for draft in (tiny, other / "model.gguf"):
        e = engine(tiny, speculative="draft", draft_model=str(draft))
        assert run_all(e, PROMPTS) == alone
        assert run_all(e, [PROMPTS[1]]) == alone[1:2]
        draft_kv = e.scheduler.proposer.kv
        assert draft_kv.num_free_blocks == draft_kv.num_blocks


def test_draft_model_must_share_the_vocabulary(tiny, default_model_path):
    with pytest.raises(KvlabError, match="a draft must share the target's vocabulary"):
        engine(tiny, speculative="draft", draft_model=str(default_model_path))


def test_a_declined_draft_keeps_its_acceptance_rate_current(tiny, alone, tmp_path):
    """Proposals declined at every step (each row costs as much as a step), the draft still
    catches up every CATCH_UP_EVERY tokens and scores its guesses against the target's
    tokens: the target as its own draft earns a high rate, another random model a low one,
    without proposing anything."""
    other = tmp_path / "other"
    build("gemma3", other, seed=1)
    for draft, start, agrees in ((tiny, 0.05, True), (other / "model.gguf", 0.95, False)):
        e = engine(tiny, speculative="draft", draft_model=str(draft))
        proposer = e.scheduler.proposer
        for _ in range(20):  # compute-bound: no fixed part, 10 ms a row
            proposer.planner.cost.observe(1, False, 0.010)
            proposer.planner.cost.observe(2, False, 0.020)
            proposer.planner.cost.observe(5, True, 0.060)
        state = DraftState(acceptance=Acceptance(prior=start))
        tokens = PROMPTS[1] + alone[1][:1]
        for token in alone[1][1:]:
            assert proposer.propose([_candidate(state, tokens)], 1) == [[]]
            tokens.append(token)
        assert (state.acceptance.rate > 0.7) if agrees else (state.acceptance.rate < 0.3)
        proposer.forget(state)
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
