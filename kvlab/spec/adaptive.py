"""How many tokens to propose: per sequence from its running acceptance rate, per step from
what the engine's own timed steps say a proposed token costs.

Plain Python, no torch. A step's seconds are fitted online (least squares with forgetting)
to the shape kvlab's step model gives a decode step (kvlab.estimate.step_model), with terms
of their own for steps where some sequence computes several rows:

    seconds = fixed + per_row * rows + several * (switch + switch_row * rows)

`fixed` is one pass over the weights, `per_row` what each row adds (the products' compute,
its attention, its sampling). A step with proposals to verify (or forced tokens' chunks)
runs other kernels and samples each verify row on the host, so it has a fixed part of its
own (`switch`) and a price per row of its own (`switch_row`): a constant surcharge would
price a batch of 8's verify rows as plain ones and propose where they cost more than they
keep. The engine cannot import the estimator (it ranks above the engine), so it fits that shape to
the decode and verify steps it times itself, from scheduling to the sampled tokens; no
threshold is fixed in advance.

A sequence whose proposals are accepted at rate a gets, from k proposals, 1 + a + ... + a^k
tokens in expectation (each is kept only if all before it were). The plan adds proposals one
at a time where they are most likely kept and keeps the allocation that maximises expected
tokens per second; when the batch is compute-bound, that is none. A sequence that proposes
nothing still has its would-be proposal checked against the token that came (a shadow
trial, free), so k grows back when the text starts repeating again: proposing tells no more
about the rate than declining does, so the plan proposes only where it expects to gain. A
rate starts at its pool's (the proposer's recent sequences of its kind: greedy, or sampled at
its temperature, whose guesses are kept far less often) and averages about the last MEMORY
trials, so a few lucky guesses of a sequence that seldom guesses right do not make it
propose.

The fit is a line, and a line is only known where it was timed: one sequence's verify rows
cost less than a batch of 8's, whose steps are compute-bound. A plan reaches at most twice
the rows of the largest verify step timed so far (one proposal where none was), so the
first verify steps of a larger batch are small and their timings place the line before the
batch proposes much.

The verify line is only measured on steps that propose, and a noisy early timing could keep
it too dear for good. After EXPLORE_EVERY declined steps the plan makes one proposal anyway,
the likeliest (one row more, not every sequence's k); each such probe after which the plan
still declines doubles the wait, so a workload where proposals never pay sees ever fewer of
them (log2 of its steps).

A draft model's proposals cost its own passes besides the verify rows: k passes for the
longest proposal, each a fixed part (the draft's weights, its vocabulary head) and a part per
row. The draft proposer times its passes apart from the step (DraftCost), and the step fit
sees the step without them:

    step seconds = fixed + per_row * rows + several * (switch + switch_row * rows)
                 + passes * draft_fixed + drafted_rows * draft_per_row
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.request import SamplingParams
from kvlab.spec.ngram import NgramIndex

RATE_PRIOR = 0.5  # the rate before any trial of any sequence of a kind
# a new sequence's rate starts at its pool's (the proposer's sequences of its kind so far),
# worth this many trials: its own trials soon outweigh it
PRIOR_TRIALS = 1
# trials a sequence's rate averages over (older ones fade): short enough to follow the text
# (a copy starts, a draft's agreement drifts), long enough that a few lucky guesses among
# misses do not lift a low rate to where proposing pays; a pool's follows the recent
# workload of its kind (a run of copies then free prose: the prose soon sets the prior)
MEMORY = 32
POOL_MEMORY = 64
FORGET = 0.97  # an older timing's weight in the cost fit, per newer one of its kind
RIDGE = 1e-4  # the cost fit's pull of each term but the fixed one toward 0, per timing
# declined steps after which one proposal (the likeliest) is made anyway, to re-measure its
# cost; each probe after which the fit still declines doubles the wait
EXPLORE_EVERY = 64
DRAFT_PRIOR = 0.25  # a draft pass's seconds before one is timed, as a share of a decode step


@dataclass
class Acceptance:
    """A sequence's running rate of accepted proposals (each trial: one proposed token up
    to and including the first rejected one). It starts at its prior (`prior` where given,
    else its pool's rate, else RATE_PRIOR), worth PRIOR_TRIALS trials; it is then the mean
    of the prior and its trials until they number `memory`, after which older trials fade
    (a running average over about the last `memory`)."""

    prior: float | None = None
    memory: int = MEMORY
    trials: int = 0
    pool: Acceptance | None = None  # the proposer's sequences together
    estimate: float = 0.0  # the rate once there are trials

    def record(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, accepted + 1)):
            self.trial(i < accepted)

    def trial(self, hit: bool) -> None:
        if self.trials == 0:
            self.estimate = self.start()
        w = max(1.0 / self.memory, 1.0 / (self.trials + PRIOR_TRIALS + 1))
        self.estimate += w * (float(hit) - self.estimate)
        self.trials += 1
        if self.pool is not None:
            self.pool.trial(hit)

    def start(self) -> float:
        """The rate before any trial."""
        if self.prior is not None:
            return self.prior
        return RATE_PRIOR if self.pool is None else self.pool.rate

    @property
    def rate(self) -> float:
        return self.estimate if self.trials else self.start()

    def expected(self, k: int) -> float:
        """Expected accepted tokens out of k proposals."""
        rate = self.rate
        return sum(rate ** i for i in range(1, k + 1))


def pool_kind(params: SamplingParams) -> str:
    """The pool a sequence's rate starts from. A greedy sequence keeps a guess where it is
    the argmax, a sampled one with the probability the target gives it, lower the hotter it
    samples: a pool of greedy copies would start sampled prose far too high. Temperatures
    share a pool by tenths, so a server's pools stay few however many values clients send."""
    return "greedy" if params.greedy else f"temperature {round(params.temperature, 1):g}"


@dataclass
class DraftState:
    """One sequence's proposer state: its n-gram index, acceptance rate, and the proposal it
    did not make last step (checked against what came instead); `kind` names the pool its
    rate starts from (pool_kind)."""

    kind: str = "greedy"
    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0  # position the shadow proposal would have started at

    @classmethod
    def of(cls, params: SamplingParams) -> DraftState:
        """The state of a sequence sampled with `params`."""
        return cls(kind=pool_kind(params))

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


class CostFit:
    """Least squares of seconds = theta . x over timed observations of a few kinds, with
    forgetting: each observation weighs FORGET times the next of its kind, so a kind seldom
    observed (verify steps while proposals are declined) keeps what it showed instead of
    fading, and nothing grows without bound. Seconds are in units of the first observation;
    every term but the first (the fixed part) has a weak ridge toward 0, worth RIDGE of its
    square per observation, which only decides what the data cannot (a slope where rows
    never varied): there the least-norm split."""

    def __init__(self, n: int, kinds: int) -> None:
        self.n = n
        self.a = [[[0.0] * n for _ in range(n)] for _ in range(kinds)]  # sum w x x^T
        self.b = [[0.0] * n for _ in range(kinds)]  # sum w x y
        self.weight = [0.0] * kinds  # sum w
        self.counts = [0] * kinds
        self.theta = [0.0] * n
        self.unit = 0.0  # seconds of the first observation

    @property
    def steps(self) -> int:
        return sum(self.counts)

    def fit(self, x: Sequence[float], seconds: float, kind: int = 0) -> None:
        if self.unit <= 0.0:
            self.unit = max(seconds, 1e-9)
        y, n, f = seconds / self.unit, self.n, FORGET
        a, b = self.a[kind], self.b[kind]
        for i in range(n):
            b[i] = b[i] * f + x[i] * y
            for j in range(n):
                a[i][j] = a[i][j] * f + x[i] * x[j]
        self.weight[kind] = self.weight[kind] * f + 1.0
        self.counts[kind] += 1
        self.theta = self._solve()

    def _solve(self, pinned: frozenset[int] = frozenset()) -> list[float]:
        """theta of (sum of the kinds' a + ridge) theta = sum of their b (Gauss-Jordan), the
        `pinned` terms held at 0 (the others fitted without them)."""
        free = [i for i in range(self.n) if i not in pinned]
        n = len(free)
        # the fixed part is free, yet the system stays solvable
        ridge = [RIDGE * sum(self.weight) * (1e-9 if i == 0 else 1.0) for i in free]
        m = [[sum(a[i][j] for a in self.a) + (ridge[r] if i == j else 0.0) for j in free]
             + [sum(b[i] for b in self.b)] for r, i in enumerate(free)]
        for c in range(n):
            pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
            m[c], m[pivot] = m[pivot], m[c]
            for r in range(n):
                if r != c and m[c][c]:
                    k = m[r][c] / m[c][c]
                    m[r] = [u - k * v for u, v in zip(m[r], m[c])]
        theta = [0.0] * self.n
        for r, i in enumerate(free):
            theta[i] = m[r][n] / m[r][r] if m[r][r] else 0.0
        return theta


class StepCost(CostFit):
    """Online fit of a step's seconds: a line in the rows computed, with a fixed part and a
    price per row of its own for steps where some sequence computes several rows (proposals
    verified, forced tokens), whose kernels, attention and sampling differ:

        seconds = fixed + per_row * rows + several * (switch + switch_row * rows)

    Plain and several-row steps are the fit's two kinds. The ridge keeps the several-row
    terms near 0 until such steps are timed, so a run tries proposals and then learns what
    they cost. Slopes are at least 0 and a several-row step costs at least a plain one of as
    many rows: physical bounds a noisy fit may cross."""

    def __init__(self) -> None:
        super().__init__(4, 2)
        self.verify_rows = 0  # the most rows a timed several-row step computed

    @property
    def plain_steps(self) -> int:
        return self.counts[0]

    def observe(self, rows: int, multi: bool, seconds: float) -> None:
        """One timed step of decodes (and proposals): rows computed, seconds taken."""
        m = float(multi)
        if multi:
            self.verify_rows = max(self.verify_rows, rows)
        self.fit((1.0, float(rows), m, m * rows), seconds, int(multi))

    def _solve(self, pinned: frozenset[int] = frozenset()) -> list[float]:
        """The fit with the plain slope held at 0 where it would come out below: one
        sequence's plain steps all compute one row, so only the verify steps place the
        plain line, and a negative slope there (its fixed part too high) would flatten
        the verify line's price per row to nothing."""
        theta = super()._solve(pinned)
        return theta if theta[1] >= 0.0 else super()._solve(pinned | {1})

    def seconds(self, rows: int, multi: bool) -> float:
        fixed, per_row, switch, switch_row = self.theta
        unit = self.unit or 1.0  # before any step: only the terms' ratios matter
        plain = max(fixed + max(per_row, 0.0) * rows, 1e-6)
        if not multi:
            return unit * plain
        return unit * max(fixed + switch + max(per_row + switch_row, 0.0) * rows, plain)


class DraftCost(CostFit):
    """Online fit of a draft model's pass: fixed + per_row * rows."""

    def __init__(self) -> None:
        super().__init__(2, 1)

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
        # each kind's sequences' trials together (pool_kind): a new one's prior
        self.pools: dict[str, Acceptance] = {}
        self.declined = 0  # steps in a row that had proposals and made none
        self.explore_every = EXPLORE_EVERY

    def plan(self, states: Sequence[DraftState], caps: Sequence[int], rows: int) -> list[int]:
        """Proposals per sequence (at most its cap) for a step that computes `rows` rows
        without them."""
        for s in states:
            self.adopt(s)
        if not self.adaptive:
            return [min(c, self.max_k) for c in caps]
        rates = [s.acceptance.rate for s in states]
        heap = [(-rates[i], i) for i, c in enumerate(caps) if c > 0]
        if not heap or not self.cost.plain_steps:  # what proposals save is timed first
            return [0] * len(states)
        heapq.heapify(heap)
        probe = [0] * len(states)
        probe[heap[0][1]] = 1  # the likeliest single proposal
        best_ks = self._best(rates, caps, heap, rows)
        if any(best_ks):
            self.declined, self.explore_every = 0, EXPLORE_EVERY
            return best_ks
        if self.declined >= self.explore_every:
            self.declined, self.explore_every = 0, 2 * self.explore_every
            return probe
        self.declined += 1
        return best_ks

    def adopt(self, state: DraftState) -> None:
        """A sequence's rate joins its kind's pool, which is its prior."""
        if state.acceptance.pool is None:
            pool = self.pools.get(state.kind)
            if pool is None:
                pool = self.pools[state.kind] = Acceptance(memory=POOL_MEMORY)
            state.acceptance.pool = pool

    def _best(self, rates: list[float], caps: Sequence[int],
              heap: list[tuple[float, int]], rows: int) -> list[int]:
        """Proposals added one at a time where most likely kept, each prefix priced by the
        fit: the allocation with the most expected tokens per second (none proposed: the
        plain step's)."""
        ks = [0] * len(rates)
        base = len(rates) / self.cost.seconds(rows, False)
        best, best_ks, tokens, added, passes = base, list(ks), float(len(rates)), 0, 0
        while heap and rows + added < self.reach(rows):
            gain, i = heapq.heappop(heap)
            ks[i] += 1
            added += 1
            passes = max(passes, ks[i])
            tokens += -gain  # rate ** ks[i]: kept only if all before it were
            if ks[i] < caps[i]:
                heapq.heappush(heap, (-rates[i] ** (ks[i] + 1), i))
            seconds = self.cost.seconds(rows + added, True) + self.drafting(passes, added)
            if tokens / seconds > best:
                best, best_ks = tokens / seconds, list(ks)
        return best_ks

    def reach(self, rows: int) -> int:
        """The most rows a verify step may compute: twice the most a timed one did, at
        least one past the step's own. The verify line is fitted where it was timed; past
        that it is a guess (a batch of 8's verify rows cost more than one sequence's), so a
        step reaches at most twice as far, and its timing places the line there."""
        return max(2 * self.cost.verify_rows, rows + 1)

    def drafting(self, passes: int, rows: int) -> float:
        """Seconds of the draft passes a proposal takes (none without a draft model)."""
        if self.draft_cost is None:
            return 0.0
        if self.draft_cost.steps == 0 or self.cost.steps == 0:  # not both timed yet
            return DRAFT_PRIOR * passes * self.cost.seconds(1, False)
        return self.draft_cost.seconds(passes, rows)
