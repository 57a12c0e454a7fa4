"""Serving predicted: kvlab's scheduler replayed over the step model, request by request.

A discrete-event simulation. Requests arrive as a load test issues them (closed loop:
`concurrency` clients, each sending its next request when its last reply ends; or at
given arrival times); kvlab's own `Scheduler` (running sequences first, then waiting
ones, under the token budget and max sequences, as configured) picks each step's work;
the step model (kvlab.estimate.step_model) says how long the step takes; the clock moves on
by that much. A sequence that samples at the end of a step emits a token then: its first
token is its TTFT, the gaps between later ones its ITLs, as a client measures them.

    t=0  step 1: prefill A, B (budget 512)     -> A, B first tokens at t1
    t1   step 2: decode A, B                    -> tokens at t2 (ITL t2 - t1)
    ...  A finishes; its client sends C at once; C is prefilled beside B's decode

A request reaches the scheduler `request_seconds` after it is sent. Part of that, the
intake, the server spends on one request at a time (its event loop parses each and hands it
to the engine thread), so requests sent together arrive `intake_seconds` apart; an idle
engine starts a step with the first, and the others join at the next step. The intake runs
on the engine's cores, so a step that runs beside it takes that much longer. That is what a
load test's closed loop sees when its clients' replies end together:

    t=0      4 clients send          intake 1 ms: A in at 1 ms, B at 2, C at 3, D at 4
    1 ms     step: prefill A         (B, C, D arrive meanwhile: the step takes 3 ms more)
    t1       step: prefill B, C, D   -> A's TTFT one step, the others' two
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlab.cache import KVCacheManager
from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec, StreamCosts
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.step_model import SeqWork, StepModel
from kvlab.request import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvlab.scheduler import Sequence as Seq

StepTime = Callable[[Sequence[SeqWork]], float]  # a step's work -> seconds
_BLOCK = 16


@dataclass(frozen=True)
class RequestSpec:
    prompt_tokens: int
    output_tokens: int
    arrival: float | None = None  # seconds; None: when a closed-loop client is free


@dataclass
class RequestTrace:
    """What the simulation saw of one request, in seconds from the start."""

    spec: RequestSpec
    sent: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.token_times))

    @property
    def finished(self) -> float:
        return self.token_times[-1]


@dataclass(frozen=True)
class ServingPrediction:
    concurrency: int
    traces: tuple[RequestTrace, ...]
    steps: int

    @property
    def duration(self) -> float:
        return max(t.finished for t in self.traces) - min(t.sent for t in self.traces)

    @property
    def output_tok_s(self) -> float:
        return sum(len(t.token_times) for t in self.traces) / self.duration

    def ttft(self, q: float) -> float:
        return percentile([t.ttft for t in self.traces], q)

    def itl(self, q: float) -> float:
        return percentile([g for t in self.traces for g in t.itl], q)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..1), as numpy's default; 0 without values."""
    return float(np.percentile(values, 100 * q)) if len(values) else 0.0


def simulate(requests: Sequence[RequestSpec], step_time: StepTime, concurrency: int,
             config: SchedulerConfig | None = None, max_steps: int = 1_000_000,
             request_seconds: float = 0.0, intake_seconds: float = 0.0) -> ServingPrediction:
    """Replay `requests` through kvlab's scheduler with `concurrency` clients in a closed
    loop (requests without an arrival time) and `step_time` per step; a request reaches the
    scheduler `request_seconds` after it is sent, `intake_seconds` of which the server
    spends on one request at a time."""
    if concurrency < 1 or not requests:
        raise ValueError("simulate needs a concurrency >= 1 and at least one request")
    if not 0.0 <= intake_seconds <= request_seconds:
        raise ValueError("simulate needs 0 <= intake_seconds <= request_seconds")
    sim = _Simulation(requests, step_time, concurrency, config or SchedulerConfig(),
                      request_seconds, intake_seconds)
    return sim.run(max_steps)


class _Simulation:
    def __init__(self, requests: Sequence[RequestSpec], step_time: StepTime, concurrency: int,
                 config: SchedulerConfig, request_seconds: float = 0.0,
                 intake_seconds: float = 0.0) -> None:
        total = sum(r.prompt_tokens + r.output_tokens for r in requests)
        self.kv = KVCacheManager(-(-total // _BLOCK) + len(requests), _BLOCK,
                                 enable_prefix_caching=False)
        self.scheduler = Scheduler(config, self.kv)
        self.step_time, self.concurrency = step_time, concurrency
        self.queue = list(enumerate(requests))  # not sent yet, in order
        self.seqs: dict[str, Seq] = {}
        self.traces: dict[str, RequestTrace] = {}
        self.clock, self.in_flight = 0.0, 0
        self.request_seconds, self.intake_seconds = request_seconds, intake_seconds
        self.intake: list[tuple[float, Seq]] = []  # sent, not yet in the scheduler: (due, seq)
        self.intake_free = 0.0  # when the server can take in its next request
        self.busy: list[tuple[float, float]] = []  # intake work not yet past: (from, to)

    def run(self, max_steps: int) -> ServingPrediction:
        steps = 0
        self._send_due()
        while self.scheduler.has_unfinished() or self.queue or self.intake:
            if not self.scheduler.has_unfinished():
                self.clock = max(self.clock, self._next_event())
                self._send_due()
                continue
            out = self.scheduler.schedule()
            if not out.scheduled:
                raise RuntimeError("the simulated scheduler made no progress (KV pool full)")
            seconds = self.step_time([SeqWork(len(s.token_ids), s.start, s.needs_logits)
                                      for s in out.scheduled])
            self.clock += seconds + self._intake_during(self.clock, seconds)
            self.scheduler.update(out, self.seqs)
            self._emit(out)
            self._send_due()
            steps += 1
            if steps >= max_steps:
                raise RuntimeError(f"the simulation ran past {max_steps} steps")
        order = sorted(self.traces, key=lambda rid: int(rid))
        return ServingPrediction(self.concurrency, tuple(self.traces[r] for r in order), steps)

    def _intake_during(self, start: float, seconds: float) -> float:
        """The intake work a step starting at `start` shares the cores with: it runs on the
        same cores, so the step takes that much longer (which may overlap further intake)."""
        extra = 0.0
        for _ in range(3):
            end = start + seconds + extra
            extra = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy)
        self.busy = [(a, b) for a, b in self.busy if b > start + seconds + extra]
        return extra

    def _next_event(self) -> float:
        """When the idle scheduler next gets work: a request through intake, or sent."""
        if self.intake:
            return min(due for due, _ in self.intake)
        arrival = self.queue[0][1].arrival
        return self.clock if arrival is None else arrival

    def _send_due(self) -> None:
        """Send every request whose time has come (closed-loop ones while a client is free),
        then admit those through intake."""
        while self.queue:
            _, spec = self.queue[0]
            due = (self.in_flight < self.concurrency if spec.arrival is None
                   else spec.arrival <= self.clock and self.in_flight < self.concurrency)
            if not due:
                break
            index, spec = self.queue.pop(0)
            rid = str(index)
            seq = Seq(rid, [0] * spec.prompt_tokens, spec.prompt_tokens,
                      SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True))
            self.seqs[rid] = seq
            sent = self.clock if spec.arrival is None else spec.arrival
            self.traces[rid] = RequestTrace(spec, sent)
            begin = max(sent, self.intake_free)
            self.intake_free = begin + self.intake_seconds
            if self.intake_seconds:
                self.busy.append((begin, self.intake_free))
            latency = self.request_seconds - self.intake_seconds  # for all at once
            self.intake.append((self.intake_free + latency, seq))
            self.in_flight += 1
        ready = [seq for due, seq in self.intake if due <= self.clock]
        self.intake = [item for item in self.intake if item[0] > self.clock]
        for seq in ready:
            self.scheduler.add(seq)

    def _emit(self, out: SchedulerOutput) -> None:
        """Sampled sequences get a token at the step's end; full replies finish."""
        for s in out.scheduled:
            if not s.needs_logits:
                continue
            seq, trace = self.seqs[s.seq_id], self.traces[s.seq_id]
            trace.token_times.append(self.clock)
            seq.token_ids.append(0)
            if len(trace.token_times) >= trace.spec.output_tokens:
                self.scheduler.finish(seq)
                self.in_flight -= 1


# -- kvlab's engine served, predicted and checked --------------------------------------------


def predict_serving(model: ModelSpec, hw: HardwareSpec, requests: Sequence[RequestSpec],
                    concurrency: int, config: SchedulerConfig | None = None,
                    kv_dtype: str = "f32") -> ServingPrediction:
    """`requests` served by kvlab on the probed `hw` with `concurrency` clients: the step
    model (with the probe's whole-step factors) under kvlab's scheduler, plus the serving
    costs besides the steps where the probe timed them (`HardwareSpec.stream`)."""
    reason = unsupported_reason(model, hw)
    if reason:
        raise KvlabError(f"cannot predict kvlab's own engine: {reason}")
    sm = StepModel(model, hw, kv_dtype)
    stream = hw.stream

    def seconds(work: Sequence[SeqWork]) -> float:
        extra = stream.step_seconds(sum(w.logits for w in work)) if stream else 0.0
        return sm.seconds(work) + extra
    return simulate(requests, _memoised(seconds), concurrency, config,
                    request_seconds=stream.request if stream else 0.0,
                    intake_seconds=stream.intake if stream else 0.0)


def _memoised(step_time: StepTime) -> StepTime:
    """`step_time` remembered by step shape: a steady batch repeats the same few shapes."""
    seen: dict[tuple[SeqWork, ...], float] = {}

    def seconds(work: Sequence[SeqWork]) -> float:
        key = tuple(work)
        if key not in seen:
            seen[key] = step_time(work)
        return seen[key]
    return seconds


def describe_stream(s: StreamCosts | None) -> str:
    """One line on the serving costs the prediction adds, for a report's notes."""
    if s is None:
        return ("the probe timed no serving: the prediction is the engine's steps alone "
                "(`kvlab probe` serves the model to time the streaming path)")
    return (f"besides the engine's steps, the streaming path costs {s.token * 1e3:.2f} ms a "
            f"token + {s.step * 1e3:.2f} ms a step + {s.request * 1e3:.1f} ms a request "
            f"({s.intake * 1e3:.1f} ms of it taken one request at a time), as the probe timed "
            "kvlab serve streaming the model to kvlab loadtest here")


SERVING_FIGURES = (("output tok/s", "output_tok_s"), ("TTFT p50 (ms)", "ttft_p50_ms"),
                   ("TTFT p99 (ms)", "ttft_p99_ms"), ("ITL p50 (ms)", "itl_p50_ms"))


def serving_figures(p: ServingPrediction) -> dict[str, float]:
    """The figures a load test reports, from a prediction: tok/s and milliseconds."""
    return {"output_tok_s": p.output_tok_s, "ttft_p50_ms": 1e3 * p.ttft(0.5),
            "ttft_p99_ms": 1e3 * p.ttft(0.99), "itl_p50_ms": 1e3 * p.itl(0.5)}


def format_serving(levels: Sequence[tuple[int, dict[str, float], dict[str, float] | None]]
                   ) -> str:
    """One row per (concurrency, predicted figures, measured figures or None): predicted,
    measured and the error in percent for each figure of SERVING_FIGURES."""
    measured_any = any(m is not None for _, _, m in levels)
    head = f"{'conc':>5}"
    for label, _ in SERVING_FIGURES:
        head += f"  {label:>14}" + (f" {'measured':>9} {'error':>7}" if measured_any else "")
    lines = [head]
    for level, pred, meas in levels:
        row = f"{level:>5}"
        for _, key in SERVING_FIGURES:
            row += f"  {pred[key]:>14,.1f}"
            if meas is not None:
                err = (meas[key] - pred[key]) / pred[key] * 100 if pred[key] else float("nan")
                row += f" {meas[key]:>9,.1f} {err:>+6.1f}%"
        lines.append(row)
    return "\n".join(lines)
