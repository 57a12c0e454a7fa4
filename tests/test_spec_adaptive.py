"""The speculation planner's decisions (kvlab.spec.adaptive), replayed on step costs recorded
on the default model (Gemma 3 270M Q4_K_M, 2 AVX2 threads) with a seeded generator: which
sequences propose, how many tokens, and how often a declined one tries again. Counts, not
timings: the replayed steps' seconds come from the recordings below, the acceptance from
Bernoulli trials at a set rate (a declined sequence's shadow trial: one a step)."""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import pairwise

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.request import SamplingParams
from kvlab.spec.adaptive import (
    EXPLORE_EVERY,
    RATE_PRIOR,
    Acceptance,
    DraftState,
    Planner,
    StepCost,
)
from kvlab.spec.draft import CATCH_UP_EVERY
from kvlab.spec.proposer import Candidate

from tiny_models import build

Cost = Callable[[int, bool], float]  # (rows, several rows somewhere) -> seconds


def batch_1(rows: int, several: bool) -> float:
    """A step alone: plain 84 ms; a verify step 97, 111, 122, 132 ms at 2 .. 5 rows."""
    return 0.073 + 0.012 * rows if several else 0.071 + 0.013 * rows


def batch_8(rows: int, several: bool) -> float:
    """Steps of 5 .. 8 sequences: plain 51 ms + 12.6 ms a row; with proposals, 21 ms a row
    (the verify path's kernels and host sampling): a verify row costs more than a plain
    one, so even a proposal that is always kept loses."""
    return 0.021 * rows if several else 0.051 + 0.0126 * rows


class Replay:
    """`steps` steps of len(rates) sequences, each proposal kept with its sequence's
    probability (up to the first miss), each step's seconds from `cost`: the plans, and
    tokens per second against plain decoding's."""

    def __init__(self, cost: Cost, rates: list[float], steps: int, seed: int = 0,
                 planner: Planner | None = None) -> None:
        rng = random.Random(seed)
        planner = planner or Planner(4)
        states = [DraftState() for _ in rates]
        self.plans: list[list[int]] = []
        tokens = seconds = 0.0
        for _ in range(steps):
            ks = planner.plan(states, [4] * len(states), len(states))
            for state, rate, k in zip(states, rates, ks):
                kept = 0
                while kept < max(k, 1) and rng.random() < rate:
                    kept += 1
                kept = min(kept, k)
                state.acceptance.record(max(k, 1), kept if k else int(rng.random() < rate))
                tokens += 1 + kept
            rows = len(states) + sum(ks)
            step = cost(rows, any(ks))
            planner.cost.observe(rows, any(ks), step)
            seconds += step
            self.plans.append(ks)
        plain = len(rates) / cost(len(rates), False)
        self.speedup = tokens / seconds / plain


def replay(cost: Cost, rates: list[float], steps: int, seed: int = 0,
           planner: Planner | None = None) -> list[list[int]]:
    return Replay(cost, rates, steps, seed, planner).plans


def test_a_low_acceptance_sequence_stops_proposing_and_retries_rarely():
    run = Replay(batch_1, [0.07], 2000)
    proposing = [i for i, (k,) in enumerate(run.plans) if k]
    assert proposing[0] == 1  # after one plain step's timing: the prior's try, then it learns
    late = proposing[1:]
    # probes, and runs of lucky hits that lift the rate near where one token pays (15 %)
    assert len(late) <= 0.04 * len(run.plans)
    assert all(run.plans[i] == [1] for i in late)
    assert run.speedup > 0.99


@pytest.mark.parametrize("rate", [0.0, 0.07, 0.15, 0.3])
def test_speculation_costs_little_at_any_rate(rate):
    for seed in range(3):
        assert Replay(batch_1, [rate], 500, seed).speedup > 0.98
        assert Replay(batch_8, [rate] * 8, 600, seed).speedup > 0.98


def test_a_high_acceptance_sequence_keeps_k():
    plans = replay(batch_1, [0.9], 400)
    assert sum(k == 4 for (k,) in plans[20:]) >= 0.9 * len(plans[20:])


def test_a_middling_rate_alone_proposes_where_a_verify_row_is_cheap():
    plans = replay(batch_1, [0.5], 400)
    assert sum(1 for (k,) in plans[20:] if k) >= 0.9 * len(plans[20:])


def test_a_batch_whose_verify_rows_cost_more_proposes_nothing_even_when_kept():
    plans = replay(batch_8, [0.95] * 8, 1000)
    proposing = [i for i, ks in enumerate(plans) if any(ks)]
    late = [i for i in proposing if i >= 50]
    assert len(late) <= 6  # probes only, their wait doubling
    assert all(sum(plans[i]) == 1 for i in late)


def test_a_constant_surcharge_would_have_priced_those_rows_as_plain_ones():
    """The reason for the verify line's own slope: fitted to the same steps, it predicts
    the verify step of a batch of 8 within a few percent."""
    cost = StepCost()
    for rows in (5, 6, 7, 8) * 20:
        cost.observe(rows, False, batch_8(rows, False))
        cost.observe(rows + 4, True, batch_8(rows + 4, True))
        cost.observe(rows + 16, True, batch_8(rows + 16, True))
    for rows in (10, 20, 30):
        assert cost.seconds(rows, True) == pytest.approx(batch_8(rows, True), rel=0.03)
    assert cost.seconds(8, False) == pytest.approx(batch_8(8, False), rel=0.03)


def test_probes_wait_twice_as_long_each_time_they_fail():
    planner = Planner(4)
    plans = replay(batch_1, [0.0], 64 + 128 + 256 + 40, planner=planner)
    probes = [i for i, (k,) in enumerate(plans) if k]
    gaps = [b - a for a, b in pairwise(probes)]
    assert gaps[-2:] == [2 * EXPLORE_EVERY + 1, 4 * EXPLORE_EVERY + 1]


def test_a_new_sequence_starts_from_the_pool_and_its_own_trials_soon_outweigh_it():
    planner = Planner(4)
    replay(batch_1, [0.02] * 2, 300, planner=planner)
    fresh = DraftState()
    planner.adopt(fresh)
    assert fresh.acceptance.rate < 0.1  # where the others stand
    for _ in range(6):
        fresh.acceptance.record(4, 4)
    assert fresh.acceptance.rate > 0.8


def test_a_long_run_of_plain_steps_leaves_the_fit_sound():
    cost = StepCost()
    for _ in range(5000):  # only plain steps of one row: the plain slope never shows
        cost.observe(1, False, 0.084)
    assert cost.seconds(1, False) == pytest.approx(0.084, rel=1e-3)
    assert cost.seconds(3, True) == pytest.approx(cost.seconds(3, False))  # untimed
    for rows in (2, 3, 4, 5) * 3:
        cost.observe(rows, True, batch_1(rows, True))
    assert cost.seconds(3, True) == pytest.approx(batch_1(3, True), rel=0.05)


def alone(rows: int, several: bool) -> float:
    """One sequence's steps, recorded under kvlab serve: plain 46 ms, a verify step 57 ..
    90 ms at 2 .. 5 rows."""
    return 0.035 + 0.011 * rows if several else 0.036 + 0.0105 * rows


def eight(rows: int, several: bool) -> float:
    """The same server's steps of 8 sequences (loadtest -c 8): plain 120 ms, a verify step
    153 ms at 9 rows and 390 ms at 23: compute-bound, a verify row 17 ms."""
    return 0.017 * rows if several else 0.036 + 0.0105 * rows


def test_a_new_sequence_first_proposes_one_token_then_reaches_twice_as_far():
    plans = replay(batch_1, [0.95], 6)
    assert plans == [[0], [1], [3], [4], [4], [4]]  # verify steps of 2, 4, then 5 rows


def test_a_larger_batch_proposes_little_before_its_verify_steps_are_timed():
    """Verify rows timed alone (cheap) say nothing of a batch of 8's (dear): the batch's
    first verify step reaches twice the rows timed (10), and once it is timed the plan
    declines; without the reach it would have proposed 32 tokens at once."""
    planner = Planner(4)
    Replay(alone, [0.95], 100, planner=planner)
    assert planner.cost.verify_rows == 5
    plans = [sum(ks) for ks in replay(eight, [0.95] * 8, 400, planner=planner)]
    proposing = [k for k in plans if k]
    assert proposing[0] == 2  # 8 + 2 rows: twice the 5 timed alone
    assert proposing[1:] == [1] * len(proposing[1:])  # probes only
    assert len(proposing) <= 4


def test_one_sequences_verify_line_keeps_its_price_per_row():
    """Plain steps of one row place only fixed + per_row; where the verify steps' fixed
    part stands well above the plain step's, the unbounded fit took a negative per_row
    (the plain step then priced too dear); the plain slope is held at 0 instead."""
    cost = StepCost()
    for _ in range(10):
        cost.observe(1, False, 0.050)
        for rows in (2, 3, 4, 5):
            cost.observe(rows, True, 0.070 + 0.005 * rows)
    assert cost.theta[1] >= 0.0
    assert cost.seconds(1, False) == pytest.approx(0.050, rel=0.01)
    for rows in (2, 5):
        assert cost.seconds(rows, True) == pytest.approx(0.070 + 0.005 * rows, rel=0.01)


def _finish(planner: Planner, params: SamplingParams, kept: int) -> None:
    """Three sequences of `params` whose 20 proposals of 4 tokens each kept `kept`."""
    for _ in range(3):
        state = DraftState.of(params)
        planner.adopt(state)
        for _ in range(20):
            state.acceptance.record(4, kept)


def test_sampled_and_greedy_sequences_start_from_pools_of_their_own():
    planner = Planner(4)
    for _ in range(40):  # one sequence alone, as its plans were timed
        planner.cost.observe(1, False, batch_1(1, False))
        for rows in (2, 3, 4, 5):
            planner.cost.observe(rows, True, batch_1(rows, True))
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    _finish(planner, greedy, kept=4)  # greedy copies: every guess kept
    fresh = DraftState.of(sampled)
    planner.adopt(fresh)
    assert fresh.acceptance.rate == RATE_PRIOR  # no sampled trial yet: neutral, not ~1
    _finish(planner, sampled, kept=0)  # sampled prose: no guess holds
    late = DraftState.of(sampled)
    planner.adopt(late)
    assert late.acceptance.rate < 0.1  # the sampled pool's, not the greedy copies' (~1)
    assert planner.plan([late], [4], 1) == [0]
    assert planner.plan([DraftState.of(greedy)], [4], 1) == [4]
    assert DraftState.of(SamplingParams(temperature=0.7)).kind != fresh.kind
    # temperatures share a pool by tenths: a server's pools stay few
    assert DraftState.of(SamplingParams(temperature=1.04)).kind == fresh.kind


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and another random model of its vocabulary, as its draft."""
    target, other = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("other")
    build("gemma3", target)
    build("gemma3", other, seed=1)
    return target / "model.gguf", other / "model.gguf"


def test_a_draft_that_never_agrees_catches_up_ever_more_seldom(pair):
    target, draft = pair
    e = Engine.from_model(str(target), EngineConfig(block_size=4, speculative="draft",
                                                    draft_model=str(draft)))
    proposer = e.scheduler.proposer
    for _ in range(20):  # compute-bound: no fixed part, 10 ms a row: every plan declines
        proposer.planner.cost.observe(1, False, 0.010)
        proposer.planner.cost.observe(2, False, 0.020)
        proposer.planner.cost.observe(5, True, 0.060)
    passes = []
    run = proposer.runner.execute
    proposer.runner.execute = lambda out: passes.append(out) or run(out)
    state = DraftState(acceptance=Acceptance(prior=0.0))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (16,), generator=generator).tolist()
    at = []
    for _ in range(300):  # tokens no model would guess
        seen = len(passes)
        proposer.propose([Candidate(state, tokens, 4)], 1)
        if len(passes) > seen:
            at.append(len(tokens))
        tokens.append(int(torch.randint(0, 90, (1,), generator=generator)))
    gaps = [b - a for a, b in pairwise(at)]
    assert gaps[0] == 2 * CATCH_UP_EVERY  # its first catch-up's one scored guess missed
    assert max(gaps) >= 4 * CATCH_UP_EVERY  # a rare lucky guess brings the wait back
    assert len(at) <= 300 // CATCH_UP_EVERY // 2  # every 8 tokens: 37
    proposer.forget(state)
