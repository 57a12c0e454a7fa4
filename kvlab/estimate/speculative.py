"""Speculative decoding predicted: the decode speed-up of proposing K tokens a step and
verifying them in one step of the target model.

A verify step computes 1 + K rows of each sequence: the weights are read once, as for a
plain decode, while the products' compute, the attention over the cache and the sampling
grow with the rows. Proposals are accepted one at a time with probability A each, and each
is kept only if all before it were, so a step yields in expectation

    1 + A + A^2 + ... + A^K = (1 - A^(K+1)) / (1 - A)   tokens

(kvlab.spec.adaptive plans with the same sum). The proposer adds its own cost: n-gram lookup
is a table probe (taken as free); a draft model decodes K passes of its own step.

    speed-up = tokens per step x plain step seconds / (verify step + proposer seconds)

At A = 0 every step pays the verify rows for one token (speed-up below 1); as A nears 1 the
speed-up nears (K + 1) x plain / verify. Where a batch of sequences is compute-bound already,
the extra rows cost their full compute and speculation gains less or loses.

A step's seconds come from a `StepSeconds` function (rows per sequence, sequences): kvlab's
step model (kvlab.estimate.step_model) where the probe measured kvlab's kernels, or the
roofline's figures in the step model's shape otherwise (`roofline_seconds`). Plain arithmetic; nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.step_model import SeqWork, StepModel
from kvlab.estimate.workload import Workload

DEFAULT_ACCEPTANCE = 0.7  # a middling rate: repetitive text (code, edits) runs higher
StepSeconds = Callable[[int, int], float]  # (rows per sequence, sequences) -> seconds


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verify step yields in expectation from `k` proposals kept at `acceptance`
    each: 1 + a + ... + a^k."""
    check_speculation(k, acceptance)
    return float(sum(acceptance ** i for i in range(k + 1)))


def acceptance_from_ratio(ratio: float, k: int) -> float:
    """The per-token acceptance a whose expected kept share of `k` proposals,
    (a + ... + a^k) / k, is the measured `ratio` (accepted / proposed tokens)."""
    if not 0.0 <= ratio <= 1.0:
        raise KvlabError(f"an accepted share of proposals is within [0, 1], got {ratio}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the share grows with a: bisect
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) / k < ratio:
            lo = mid
        else:
            hi = mid
    return min(lo, 0.999)


def check_speculation(k: int, acceptance: float) -> None:
    if k < 1:
        raise KvlabError(f"--speculative is the tokens proposed per step, >= 1; got {k}")
    if not 0.0 <= acceptance < 1.0:
        raise KvlabError(f"--acceptance is a per-token acceptance rate in [0, 1), got "
                         f"{acceptance} (at 1 every proposal would be kept forever)")


@dataclass(frozen=True)
class SpecPoint:
    """Speculation against plain decode for `concurrency` sequences decoding together."""

    concurrency: int
    plain_step: float  # seconds of a plain decode step, one row per sequence
    verify_step: float  # seconds of a step of 1 + K rows per sequence
    propose: float  # the proposer's seconds a step
    tokens_per_step: float  # per sequence, in expectation

    @property
    def plain_tok_s(self) -> float:
        """Tokens/s per sequence without speculation."""
        return 1.0 / self.plain_step

    @property
    def tok_s(self) -> float:
        """Tokens/s per sequence with speculation."""
        return self.tokens_per_step / (self.verify_step + self.propose)

    @property
    def speedup(self) -> float:
        return self.tok_s / self.plain_tok_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"plain_tok_s": self.plain_tok_s, "tok_s": self.tok_s,
                               "speedup": self.speedup}


@dataclass(frozen=True)
class SpecEstimate:
    k: int
    acceptance: float
    acceptance_given: bool  # False: DEFAULT_ACCEPTANCE stood in
    proposer: str  # "ngram" or the draft model's name
    source: str  # what priced the steps
    points: tuple[SpecPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "acceptance": self.acceptance,
                "acceptance_given": self.acceptance_given, "proposer": self.proposer,
                "source": self.source,
                "tokens_per_step": expected_tokens(self.k, self.acceptance),
                "points": [p.to_dict() for p in self.points]}

    def format(self) -> str:
        tokens = expected_tokens(self.k, self.acceptance)
        lines = [(f"speculative decoding: {self.k} tokens proposed a step by {self.proposer}, "
                 f"acceptance {self.acceptance:.2f} a token -> {tokens:.2f} tokens a verify "
                 f"step of {self.k + 1} rows ({self.source}; tok/s a sequence)")]
        if not self.acceptance_given:
            lines.append(f"  acceptance {DEFAULT_ACCEPTANCE} is a stand-in: give the rate your "
                         "text reaches with --acceptance (`kvlab bench --speculative` measures it)")
        for p in self.points:
            lines.append(
                f"  {p.concurrency:>3} seq: plain {p.plain_tok_s:,.1f} tok/s "
                f"({p.plain_step * 1e3:.2f} ms a step), speculative {p.tok_s:,.1f} tok/s "
                f"(verify {p.verify_step * 1e3:.2f} ms + proposer {p.propose * 1e3:.2f} ms): "
                f"x{p.speedup:.2f}{_verdict(p, self.points[0])}")
        return "\n".join(lines) + "\n\n"


def _verdict(p: SpecPoint, alone: SpecPoint) -> str:
    """Why a point gains less than one sequence alone, or loses."""
    batch = p.concurrency > 1 and p.speedup < alone.speedup
    if p.speedup >= 1.0:
        return (" - less than alone: the batch shares its weight read already, so the extra "
                "rows' compute weighs more") if batch else ""
    if p.propose > p.verify_step - p.plain_step:
        return " - a slowdown: the draft's passes cost more than the kept tokens save"
    if batch:
        return " - a slowdown: the batch is compute-bound, its extra rows cost in full"
    return " - a slowdown: the verify rows cost more than the kept tokens save"


def predict_speculative(step: StepSeconds, k: int, acceptance: float,
                        concurrencies: Sequence[int], draft: StepSeconds | None = None,
                        proposer: str = "ngram", source: str = "",
                        acceptance_given: bool = True) -> SpecEstimate:
    """Speculation of `k` tokens at `acceptance` against plain decode at each concurrency;
    `draft` prices one decode pass of the draft model (None: an n-gram proposer, free)."""
    tokens = expected_tokens(k, acceptance)
    points = tuple(SpecPoint(n, step(1, n), step(k + 1, n), k * draft(1, n) if draft else 0.0,
                             tokens) for n in dict.fromkeys(concurrencies))
    return SpecEstimate(k, acceptance, acceptance_given, proposer, source, points)


def step_seconds(model: ModelSpec, hw: HardwareSpec, workload: Workload, context: int,
                 own_engine: bool = True) -> tuple[StepSeconds, str]:
    """kvlab's step model where `own_engine` and the probe's kernel rates cover `model`, else
    the roofline's figures; and which one priced the steps."""
    if own_engine and unsupported_reason(model, hw) is None:
        sm = StepModel(model, hw, workload.kv_dtype)
        return step_model_seconds(sm, context), "kvlab's step model"
    return (roofline_seconds(model, hw, workload, context),
            "the roofline's figures in the step model's shape")


@dataclass(frozen=True)
class SpecRun:
    """What a run with speculation counted while decoding `tokens` tokens of one sequence."""

    tokens: int
    runs: int  # verify steps: steps where the sequence had proposals
    drafted: int
    accepted: int

    @property
    def k(self) -> int:
        """Tokens proposed a verify step, on average."""
        return max(1, round(self.drafted / self.runs)) if self.runs else 1

    @property
    def acceptance(self) -> float:
        return acceptance_from_ratio(self.accepted / self.drafted if self.drafted else 0.0,
                                     self.k)


@dataclass(frozen=True)
class SpecCheck:
    """A run's decode predicted at its own acceptance and proposals: its verify steps at the
    step model's price, each yielding the expected tokens, the rest plain decode steps."""

    run: SpecRun
    estimate: SpecEstimate  # one sequence, at the run's k and acceptance

    @property
    def plain_steps(self) -> float:
        point = self.estimate.points[0]
        return max(self.run.tokens - self.run.runs * point.tokens_per_step, 0.0)

    @property
    def tok_s(self) -> float:
        p = self.estimate.points[0]
        seconds = self.run.runs * (p.verify_step + p.propose) + self.plain_steps * p.plain_step
        return self.run.tokens / seconds if seconds else p.plain_tok_s


def check_run(model: ModelSpec, hw: HardwareSpec, workload: Workload, run: SpecRun,
              draft: ModelSpec | None = None) -> SpecCheck:
    """The decode tok/s a run with speculation should have reached over `workload`'s reply."""
    context = workload.prompt_tokens + workload.output_tokens // 2
    step, source = step_seconds(model, hw, workload, context)
    draft_step = None if draft is None else step_seconds(draft, hw, workload, context)[0]
    name = "n-gram lookup" if draft is None else f"the draft {draft.name}"
    return SpecCheck(run, predict_speculative(step, run.k, run.acceptance, (1,), draft_step,
                                              name, source))


def step_model_seconds(sm: StepModel, context: int) -> StepSeconds:
    """Steps from kvlab's step model, each sequence at `context` cached positions: a verify
    step is a chunk of 1 + K rows sampled at every row."""
    def seconds(rows: int, sequences: int) -> float:
        work = [SeqWork(rows, context)] * sequences
        return sm.seconds(work) + sequences * (rows - 1) * sm.logit
    return seconds


def roofline_seconds(model: ModelSpec, hw: HardwareSpec, workload: Workload,
                     context: int) -> StepSeconds:
    """Steps shaped as kvlab's step model prices them, from the roofline's figures: the
    weights and each sequence's KV read once at the middle of the efficiency range (the
    first row's compute hidden under the read), each further row at its FLOP / FLOP/s. A
    kernel that overlaps the rows' compute with the read gains more than this."""
    eff = sum(workload.efficiency) / 2
    rate = hw.flop_rate(workload.compute_dtype or hw.default_dtype)
    kv = float(model.kv_bytes(context, workload.kv_bytes_per_element))
    per_row = (model.matmul_flop_per_token() + model.output_flop
               + float(model.attention_flop(context))) / rate

    def seconds(rows: int, sequences: int) -> float:
        memory = (model.decode_weight_bytes(rows * sequences) + sequences * kv) / hw.bandwidth
        return max(memory / eff, per_row) + (rows * sequences - 1) * per_row
    return seconds
