"""How many tokens to propose: per sequence from its running acceptance rate, per step from
what the engine's own timed steps say a proposed token costs.

Plain Python, no torch. A step's seconds are fitted online (recursive least squares with
forgetting) to the shape kvlab's step model gives a decode step (kvlab.estimate.step_model):

    seconds = fixed + per_row * rows + multi * [some sequence computes several rows]

`fixed` is one pass over the weights, `per_row` what each row adds (the products' compute,
its attention, its sampling), `multi` what a step where some sequence has several rows adds
on top (proposing, verifying; forced tokens' chunks). The engine cannot import the
estimator (it ranks above the engine), so it fits that shape to the decode and verify steps
it times itself, from scheduling to the sampled tokens; no threshold is fixed in advance.

A sequence whose proposals are accepted at rate a gets, from k proposals, 1 + a + ... + a^k
tokens in expectation (each is kept only if all before it were). The plan adds proposals one
at a time where they are most likely kept and keeps the allocation that maximises expected
tokens per second; when the batch is compute-bound, that is none. A sequence that proposes
nothing still has its would-be proposal checked against the token that came (a shadow
trial, free), so k grows back when the text starts repeating again.

A draft model's proposals cost its own passes besides the verify rows: k passes for the
longest proposal, each a fixed part (the draft's weights, its vocabulary head) and a part per
row. The draft proposer times its passes apart from the step (DraftCost), and the step fit
sees the step without them:

    step seconds = fixed + per_row * rows + multi * [several rows]
                 + passes * draft_fixed + drafted_rows * draft_per_row
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.spec.ngram import NgramIndex

RATE_PRIOR = 0.5  # a new sequence's acceptance rate before any trial
RATE_WEIGHT = 0.25  # weight of each new trial in the running rate (prompt lookup's)
# a draft model's: its agreement with the target drifts slowly, and its shadow trials come
# one a token, so its rate averages over more of them (about the last 20)
DRAFT_RATE_WEIGHT = 0.05
FORGET = 0.97  # older steps' weight in the cost fit, per step
EXPLORE_EVERY = 64  # declined steps after which one proposes anyway: re-measures its cost
DRAFT_PRIOR = 0.25  # a draft pass's seconds before one is timed, as a share of a decode step


@dataclass
class Acceptance:
    """A sequence's running rate of accepted proposals (each trial: one proposed token up
    to and including the first rejected one). A trial's weight starts at RATE_WEIGHT and
    falls as trials come, to `weight`: the prior is soon outweighed either way."""

    rate: float = RATE_PRIOR
    weight: float = RATE_WEIGHT  # the least weight of a new trial
    trials: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, accepted + 1)):
            w = max(self.weight, RATE_WEIGHT / (1.0 + self.trials * RATE_WEIGHT))
            self.rate += w * (float(i < accepted) - self.rate)
            self.trials += 1

    def expected(self, k: int) -> float:
        """Expected accepted tokens out of k proposals."""
        return sum(self.rate ** i for i in range(1, k + 1))


@dataclass
class DraftState:
    """One sequence's proposer state: its n-gram index, acceptance rate, and the proposal it
    did not make last step (checked against what came instead)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0  # position the shadow proposal would have started at

    def check_shadow(self, token_ids: Sequence[int]) -> None:
        """Score last step's unmade proposal against the tokens that came since."""
        if not self.shadow:
            return
        came = token_ids[self.shadow_at:self.shadow_at + len(self.shadow)]
        accepted = 0
        while accepted < len(came) and came[accepted] == self.shadow[accepted]:
            accepted += 1
        if came:
            self.acceptance.record(min(len(came), len(self.shadow)), accepted)
        self.shadow = []


class OnlineFit:
    """Recursive least squares with forgetting: seconds = theta . x, in units of the first
    observation's seconds (so the prior's variances mean the same at any speed)."""

    def __init__(self, prior: Sequence[float]) -> None:
        n = len(prior)
        self.theta = [0.0] * n
        self.p = [[prior[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.unit = 0.0  # seconds of the first observation
        self.steps = 0

    def fit(self, x: Sequence[float], seconds: float) -> None:
        if self.unit <= 0.0:
            self.unit = max(seconds, 1e-9)
        seconds /= self.unit
        n = len(x)
        px = [sum(self.p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = FORGET + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        err = seconds - sum(t * v for t, v in zip(self.theta, x))
        self.theta = [t + g * err for t, g in zip(self.theta, gain)]
        self.p = [[(self.p[i][j] - gain[i] * px[j]) / FORGET for j in range(n)]
                  for i in range(n)]
        self.steps += 1


class StepCost(OnlineFit):
    """Online fit of a step's seconds: fixed + per_row * rows + multi * [several rows].

    The prior says rows and the switch cost little beside the fixed pass (variance 1 against
    1e4), so a run that has timed only one-token steps tries proposals and then learns their
    cost; forgetting lets the data outweigh it."""

    def __init__(self) -> None:
        super().__init__((1e4, 1.0, 1.0))

    def observe(self, rows: int, multi: bool, seconds: float) -> None:
        """One timed step of decodes (and proposals): rows computed, seconds taken."""
        self.fit((1.0, float(rows), float(multi)), seconds)

    def seconds(self, rows: int, multi: bool) -> float:
        fixed, per_row, switch = self.theta
        unit = self.unit or 1.0  # before any step: only the terms' ratios matter
        return unit * (max(fixed, 1e-6) + max(per_row, 0.0) * rows
                       + (max(switch, 0.0) if multi else 0.0))


class DraftCost(OnlineFit):
    """Online fit of a draft model's pass: fixed + per_row * rows. Its first timed pass is
    often a catch-up chunk of many rows, so neither term is favoured a priori."""

    def __init__(self) -> None:
        super().__init__((1e4, 1e4))

    def observe(self, rows: int, seconds: float) -> None:
        """One timed draft pass: rows computed (all sequences), seconds taken."""
        self.fit((1.0, float(rows)), seconds)

    def seconds(self, passes: int, rows: int) -> float:
        """Seconds of `passes` passes computing `rows` rows in all."""
        fixed, per_row = self.theta
        return self.unit * (max(fixed, 1e-6) * passes + max(per_row, 0.0) * rows)


class Planner:
    """Sizes each step's proposals (see the module docstring)."""

    def __init__(self, max_k: int, adaptive: bool = True, draft: bool = False) -> None:
        """adaptive False: every sequence takes all of its proposal, up to max_k. draft: the
        proposals cost draft passes, timed into `draft_cost`."""
        if max_k < 1:
            raise ValueError(f"the number of speculative tokens must be >= 1, got {max_k}")
        self.max_k, self.adaptive = max_k, adaptive
        self.cost = StepCost()
        self.draft_cost = DraftCost() if draft else None
        self.declined = 0  # steps in a row that had proposals and made none

    def plan(self, states: Sequence[DraftState], caps: Sequence[int], rows: int) -> list[int]:
        """Proposals per sequence (at most its cap) for a step that computes `rows` rows
        without them."""
        if not self.adaptive:
            return [min(c, self.max_k) for c in caps]
        ks = [0] * len(states)
        heap = [(-s.acceptance.rate, i) for i, (s, c) in enumerate(zip(states, caps)) if c > 0]
        if not heap:
            return ks
        explore = self.declined >= EXPLORE_EVERY
        heapq.heapify(heap)
        base = len(states) / self.cost.seconds(rows, False)
        best, best_ks, tokens, added, passes = base, list(ks), float(len(states)), 0, 0
        while heap:
            gain, i = heapq.heappop(heap)
            ks[i] += 1
            added += 1
            passes = max(passes, ks[i])
            tokens += -gain  # rate ** ks[i]: kept only if all before it were
            rate = states[i].acceptance.rate
            if ks[i] < caps[i]:
                heapq.heappush(heap, (-rate ** (ks[i] + 1), i))
            seconds = self.cost.seconds(rows + added, True) + self.drafting(passes, added)
            if tokens / seconds > best or explore:
                best, best_ks = tokens / seconds, list(ks)
        self.declined = self.declined + 1 if not any(best_ks) else 0
        return best_ks

    def drafting(self, passes: int, rows: int) -> float:
        """Seconds of the draft passes a proposal takes (none without a draft model)."""
        if self.draft_cost is None:
            return 0.0
        if self.draft_cost.steps == 0 or self.cost.steps == 0:  # not both timed yet
            return DRAFT_PRIOR * passes * self.cost.seconds(1, False)
        return self.draft_cost.seconds(passes, rows)
