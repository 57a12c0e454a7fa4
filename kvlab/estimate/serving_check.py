"""kvlab serving each load a load test measured, predicted, beside what it measured: the
run's own requests (prompt tokens less those the prefix cache served, output tokens, in the
order and with the concurrency or arrival times the load test used) replayed through kvlab's
scheduler over the step model (kvlab.estimate.serving_replay) on the probed rates. Nothing
from the run's timings enters the prediction; the CLI prints what this returns.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec
from kvlab.estimate.serving_replay import (
    RequestSpec,
    ServingPrediction,
    describe_stream,
    format_serving,
    predict_serving,
    serving_figures,
)
from kvlab.estimate.step_model import describe_factors
from kvlab.estimate.verdict import misses
from kvlab.scheduler import SchedulerConfig


class LoadShape(Protocol):
    """How a load test issued its requests (kvlab.harness.loadtest.LoadConfig)."""

    concurrency: int | None
    rate: float | None
    seed: int


class RequestFigures(Protocol):
    """One request as the load test saw it (kvlab.harness.loadtest.RequestResult)."""

    ok: bool
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class LoadFigures(Protocol):
    """A load level's summary (kvlab.harness.loadtest.Summary)."""

    output_throughput: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]


TTFT_TOLERANCE, THROUGHPUT_TOLERANCE = 0.30, 0.20  # the aims, per figure


@dataclass(frozen=True)
class Predictor:
    model: ModelSpec
    hw: HardwareSpec
    config: SchedulerConfig
    kv_dtype: str

    def level(self, cfg: LoadShape, results: Sequence[RequestFigures]) -> ServingPrediction:
        """The run's completed requests, replayed as the load test issued them."""
        ok = [r for r in results if r.ok]
        if not ok:
            raise KvlabError("no request completed: nothing to predict")
        arrivals = _arrivals(cfg, len(results))
        specs = [RequestSpec(max(r.prompt_tokens - r.cached_tokens, 1), max(r.output_tokens, 1),
                             arrivals[i]) for i, r in enumerate(results) if r.ok]
        concurrency = cfg.concurrency or len(specs)
        return predict_serving(self.model, self.hw, specs, concurrency, self.config,
                               self.kv_dtype)


def _arrivals(cfg: LoadShape, n: int) -> list[float | None]:
    """Send times of the load test's Poisson arrivals (same seed), or None (closed loop)."""
    if not cfg.rate:
        return [None] * n
    rng, t, times = random.Random(cfg.seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(cfg.rate)
    return times


def measured_figures(s: LoadFigures) -> dict[str, float]:
    return {"output_tok_s": s.output_throughput, "ttft_p50_ms": s.ttft_ms["p50"],
            "ttft_p99_ms": s.ttft_ms["p99"], "itl_p50_ms": s.itl_ms["p50"]}


def format_check(p: Predictor, levels: list[tuple[int, ServingPrediction, LoadFigures]]) -> str:
    """The predicted-against-measured table of every level, and how many figures missed."""
    rows = [(level, serving_figures(pred), measured_figures(s)) for level, pred, s in levels]
    head = (f"prediction: kvlab serving {p.model.name} on {p.hw.name} (scheduler: max "
            f"{p.config.max_num_seqs} sequences, {p.config.max_num_batched_tokens} tokens a "
            f"step; {p.kv_dtype} KV); error = measured against predicted")
    notes = ([describe_factors(p.hw.steps), describe_stream(p.hw.stream), _NOT_MODELLED]
             + _stall_notes(levels) + _gap_notes(rows))
    return "\n".join([head, format_serving(rows), _verdict(rows)] + [f"note: {n}" for n in notes])


STALLS = 1.2  # measured ITL mean / p50 above this: steps slowed now and then


def _stall_notes(levels: list[tuple[int, ServingPrediction, LoadFigures]]) -> list[str]:
    """Levels whose measured token gaps have a mean well above their median: some steps ran
    far slower (other work on the cores); throughput follows the mean, the step model the
    median of the probe's repeats."""
    stalled = [f"{level} ({s.itl_ms['mean'] / s.itl_ms['p50']:.2f})" for level, _, s in levels
               if s.itl_ms["p50"] and s.itl_ms["mean"] > STALLS * s.itl_ms["p50"]]
    if not stalled:
        return []
    return ["measured ITL mean / p50 at " + ", ".join(stalled) + ": some steps ran far slower "
            "than most (other work on the cores); output tok/s follows the mean step, the "
            "prediction the median"]


def _gap_notes(rows: list[tuple[int, dict[str, float], dict[str, float]]]) -> list[str]:
    """The measured token gap past the predicted one at one stream (the prediction holds
    the streaming path's cost where the probe timed it): what is left, read off the run."""
    alone = [(pred, meas) for level, pred, meas in rows if level == 1]
    if not alone:
        return []
    pred, meas = alone[0]
    gap = meas["itl_p50_ms"] - pred["itl_p50_ms"]
    return [(f"at one stream each token took {gap:+.1f} ms beside the predicted engine step "
            f"({meas['itl_p50_ms']:.1f} against {pred['itl_p50_ms']:.1f} ms): the server's "
            "streaming path and the client's, past what the probe timed, or other work "
            "on the cores")]


_NOT_MODELLED = ("not modelled: other work sharing the cores while the load runs (the probe's "
                 "medians hold for a machine as busy as during the probe)")


def _verdict(rows: list[tuple[int, dict[str, float], dict[str, float]]]) -> str:
    missed = [f"{key} at {level}" for level, pred, meas in rows
              for key, tol in (("output_tok_s", THROUGHPUT_TOLERANCE),
                               ("ttft_p50_ms", TTFT_TOLERANCE))
              if misses(pred[key], meas[key], tol)]
    if not missed:
        return (f"output tok/s within {THROUGHPUT_TOLERANCE:.0%} and TTFT p50 within "
                f"{TTFT_TOLERANCE:.0%} at every level")
    return f"off by more than the aim: {', '.join(missed)}"


def as_dict(pred: ServingPrediction) -> dict[str, Any]:
    return {"concurrency": pred.concurrency, "steps": pred.steps, **serving_figures(pred)}
