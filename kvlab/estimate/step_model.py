"""One engine step of kvlab over any mix of sequences: decodes batched together, prefill
chunks beside them under the token budget, any KV dtype.

A step is a list of `SeqWork` (rows computed, cached positions before them, whether it
samples), as kvlab's scheduler hands it to the runner. Its seconds, by group of terms:

    fixed      one pass over every weight (the products read each matrix once, whatever
               the rows) + the engine's per-step, per-layer and per-position calls
    batch      each decode row past the first: its products at the prefill product rate,
               its element-wise passes; each sampled row past the first: its output product
               and its sampling
    prefill    each row of a prefill chunk: products and element-wise passes
    kv         each decoding sequence's attention over its own context, at the KV dtype's
               bytes per element
    attention  each chunk's prefill attention over its key range (kvlab computes every
               (query, key) pair from the chunk's first visible key on, then masks)

Every term comes from the kernel rates `kvlab probe` measured (kvlab.estimate.kernel_steps);
`StepFactors`, fitted here to whole steps the probe timed (kvlab.probe.steps), scale
each group to what a real step costs. Without factors the terms are the kernels' best.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec, StepFactors
from kvlab.estimate.kernel_steps import (
    DecodeTerms,
    KvlabPrediction,
    PrefillTerms,
    StepCosts,
    reply_contexts,
    unsupported_reason,
)
from kvlab.estimate.workload import KV_BYTES_PER_ELEMENT, Workload

_F32_BYTES = KV_BYTES_PER_ELEMENT["f32"]
CHUNK = 512  # kvlab's default token budget a step: how a long prompt is chunked
FACTOR_RANGE = (0.25, 4.0)  # a fitted factor outside it is noise: clamped
KV_FACTOR_RANGE = (0.25, 16.0)  # q8_0 dequantizes on gather: far slower than its bytes
GROUPS = ("fixed", "batch", "prefill", "kv", "attention")


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step."""

    tokens: int  # rows computed this step: 1 for a decode, the chunk length for prefill
    start: int  # positions already in its KV cache
    logits: bool = True  # the step ends at its last known token and samples one


@dataclass(frozen=True)
class StepTerms:
    """Kernel-rate seconds of one step by group (see the module docstring)."""

    fixed: float
    batch: float
    prefill: float
    kv: float
    attention: float

    def scaled(self, f: StepFactors | None, kv_dtype: str) -> StepTerms:
        if f is None:
            return self
        return StepTerms(self.fixed * f.fixed, self.batch * f.batch, self.prefill * f.prefill,
                         self.kv * f.kv_factor(kv_dtype), self.attention * f.prefill_attention)

    @property
    def total(self) -> float:
        return self.fixed + self.batch + self.prefill + self.kv + self.attention


class StepModel:
    """Seconds of kvlab steps for `model` on the probed `hw` with a `kv_dtype` cache."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, kv_dtype: str = "f32",
                 factors: StepFactors | None = None) -> None:
        assert hw.kernels is not None
        self.costs = StepCosts(model, hw.kernels)
        self.model, self.kv_dtype, self.fp32 = model, kv_dtype, hw.flop_rate("fp32")
        self.factors = factors if factors is not None else hw.steps
        rates, out = hw.kernels, self.costs.output
        self.row = (sum(2.0 * m.rows * m.cols / rates.prefill_rate(m.qtype)
                        for m in self.costs.matrices) + self.costs.row_op_seconds())
        vocab = model.vocab_size or out.rows
        self.logit = (2.0 * out.rows * out.cols / rates.prefill_rate(out.qtype)
                      + vocab * rates.logit_seconds)
        self.output_read = self.costs.read_seconds(out) + rates.call_seconds
        self.weights = self.costs.weights_seconds()

    def terms(self, work: Sequence[SeqWork]) -> StepTerms:
        """Unscaled kernel-rate terms of one step over `work`."""
        decodes = [w for w in work if w.tokens == 1]
        chunks = [w for w in work if w.tokens > 1]
        sampled = sum(w.logits for w in work)
        reach = max((w.start + w.tokens for w in work), default=0)
        fixed = (self.weights - (0.0 if sampled else self.output_read)
                 + self.costs.overhead(reach))
        extra_rows = len(decodes) - (0 if chunks else min(len(decodes), 1))
        batch = extra_rows * self.row + max(sampled - 1, 0) * self.logit
        prefill = sum(w.tokens for w in chunks) * self.row
        kv = sum(self.kv_seconds(w.start + 1) for w in decodes)
        attention = sum(self.chunk_attention_flop(w) for w in chunks) / self.fp32
        return StepTerms(fixed, batch, prefill, kv, attention)

    def seconds(self, work: Sequence[SeqWork]) -> float:
        return self.scaled_terms(work).total

    def scaled_terms(self, work: Sequence[SeqWork]) -> StepTerms:
        """`terms` scaled by the probe's factors; where it timed several depths or batch
        sizes, each decode's KV at its own depth and the batch at the step's sequences."""
        t, f = self.terms(work), self.factors
        if f is None:
            return t
        depths = f.kv_depths.get(self.kv_dtype)
        kv = (sum(self.depth_kv_seconds(w.start + 1, depths) for w in work if w.tokens == 1)
              if depths else t.kv * f.kv_factor(self.kv_dtype))
        prefill = (sum(w.tokens * self.row * f.prefill_factor(w.tokens) for w in work
                       if w.tokens > 1) if f.prefill_sizes else t.prefill * f.prefill)
        return StepTerms(t.fixed * f.fixed, t.batch * f.batch_factor(len(work)), prefill, kv,
                         t.attention * f.prefill_attention)

    def kv_seconds(self, context: float) -> float:
        """One decode's attention over `context` positions at this model's KV dtype."""
        bpe = KV_BYTES_PER_ELEMENT[self.kv_dtype]
        return self.costs.kv_seconds(context) * bpe / _F32_BYTES

    def depth_kv_seconds(self, context: float,
                         depths: Sequence[tuple[float, float]]) -> float:
        """One decode's attention over `context` positions, each stretch of positions at
        the factor timed for it (`StepFactors.kv_depths`):

            depths (1024, a), (4096, b):  positions 1..1024 at a, 1025.. at b
        """
        seconds, before = 0.0, 0.0
        for i, (depth, factor) in enumerate(depths):
            end = context if i == len(depths) - 1 else min(context, depth)
            if end > before:
                seconds += factor * (self.kv_seconds(end) - self.kv_seconds(before))
            before = depth
        return seconds

    def chunk_attention_flop(self, w: SeqWork) -> float:
        """FLOP of one chunk's prefill attention: its queries against every key from the
        first one its first query sees (window layers: `window` back) to its last row.

            start 5, tokens 3, window 4:  keys 2 3 4 5 6 7   (first visible: 5 - 4 + 1)
        """
        flop = 0.0
        for lyr in self.model.layers:
            first = 0 if lyr.window is None else max(0, w.start - lyr.window + 1)
            flop += lyr.attn_flop_per_key * w.tokens * (w.start + w.tokens - first)
        return flop

    def decode_seconds(self, contexts: Sequence[int]) -> float:
        """A decode step of one row per sequence, each at its cached `contexts`."""
        return self.seconds([SeqWork(1, c) for c in contexts])

    def prefill_seconds(self, tokens: int, start: int = 0, logits: bool = True) -> float:
        """One prefill chunk of `tokens` rows after `start` cached positions, alone."""
        return self.seconds([SeqWork(tokens, start, logits)])

    def prompt_seconds(self, prompt: int, chunk: int, start: int = 0) -> float:
        """A whole prompt of `prompt` tokens in chunks of at most `chunk`, alone: TTFT."""
        seconds, done = 0.0, 0
        while done < prompt:
            n = min(chunk, prompt - done)
            seconds += self.prefill_seconds(n, start + done, logits=done + n == prompt)
            done += n
        return seconds


def describe_factors(f: StepFactors | None) -> str:
    """One line on what scaled the kernel terms, for a report's notes."""
    if f is None:
        return ("the probe timed no whole steps: the prediction is the kernels' medians alone, "
                "which a real step does not reach (`kvlab probe` times the steps)")
    kv = ", ".join(f"{d} x{v:.2f}" for d, v in f.kv.items())
    return (f"the kernel terms are scaled to whole steps the probe timed on a replica of "
            f"{f.model or 'a model'} (fixed x{f.fixed:.2f}, batch x{f.batch:.2f}, prefill "
            f"x{f.prefill:.2f}, KV {kv}); the probe's repeats spread up to {f.noise:.0%}")


def predict(model: ModelSpec, hw: HardwareSpec, workload: Workload) -> KvlabPrediction:
    """kvlab's prefill and decode times for one sequence of `workload` on the probed `hw`."""
    reason = unsupported_reason(model, hw)
    if reason:
        raise KvlabError(f"cannot predict kvlab's own engine: {reason}")
    if workload.concurrency != 1:
        raise KvlabError(f"kvlab's step model covers one sequence at a time, got concurrency "
                         f"{workload.concurrency}; use the roofline for batches")
    assert hw.kernels is not None
    if hw.steps is not None:  # whole steps were timed: their factors scale the terms
        return predict_one(model, hw, workload)
    steps = StepCosts(model, hw.kernels)
    contexts = reply_contexts(workload)
    terms = [steps.decode(c) for c in contexts]
    mean = DecodeTerms(*(float(np.mean([getattr(t, f) for t in terms]))
                         for f in ("weights", "kv", "overhead")))
    return KvlabPrediction(workload, steps.prefill(workload.prompt_tokens, hw.flop_rate("fp32")),
                           mean, terms[0], terms[-1])


def predict_one(model: ModelSpec, hw: HardwareSpec, workload: Workload, chunk: int = CHUNK
                ) -> KvlabPrediction:
    """One sequence of `workload` alone, as kernel_steps would report it, from the step
    model with the probe's factors: the prompt in chunks of `chunk`, then each decode step."""
    sm = StepModel(model, hw, workload.kv_dtype)
    f, prompt = sm.factors, workload.prompt_tokens
    first = StepTerms(0.0, 0.0, 0.0, 0.0, 0.0)
    for done in range(0, prompt, chunk):
        n = min(chunk, prompt - done)
        t = sm.scaled_terms([SeqWork(n, done, done + n == prompt)])
        first = StepTerms(*(a + b for a, b in zip(_fields(first), _fields(t))))
    rows = sm.costs.row_op_seconds() / sm.row  # the element-wise share of a prefill row
    prefill = PrefillTerms(first.prefill * (1 - rows), first.attention, first.prefill * rows,
                           first.fixed)
    terms = [_decode_terms(sm, c) for c in reply_contexts(workload)]
    mean = DecodeTerms(*(float(np.mean([getattr(t, n) for t in terms]))
                         for n in ("weights", "kv", "overhead")))
    name = f.model if f is not None and f.model else "a model"
    return KvlabPrediction(workload, prefill, mean, terms[0], terms[-1], steps_from=name)


def _fields(t: StepTerms) -> tuple[float, ...]:
    return (t.fixed, t.batch, t.prefill, t.kv, t.attention)


def _decode_terms(sm: StepModel, context: int) -> DecodeTerms:
    """A decode attending to `context` positions, its fixed part split as weights and glue."""
    scale = sm.factors.fixed if sm.factors is not None else 1.0
    overhead = sm.costs.overhead(context) * scale
    scaled = sm.scaled_terms([SeqWork(1, context - 1)])
    return DecodeTerms(scaled.fixed - overhead, scaled.kv, overhead)


# -- fitting the factors to timed steps ------------------------------------------------------


@dataclass(frozen=True)
class TimedStep:
    """A step shape the probe timed, and the median of its repeats."""

    name: str
    work: tuple[SeqWork, ...]
    seconds: float  # median over repeats
    spread: float  # interquartile range / median of the repeats
    kv_dtype: str = "f32"


def fit_factors(model: ModelSpec, hw: HardwareSpec, timed: Sequence[TimedStep],
                name: str = "") -> StepFactors:
    """The factors that bring `StepModel`'s terms to the `timed` steps, in order: fixed and
    KV from single decodes at the KV dtype the prefill chunks ran with (one KV factor per
    stretch between the depths timed, where more than two), batch from larger decode
    batches (a factor per batch size, where more than one), prefill and its attention from
    prefill chunks, then the KV factor of each other dtype from the difference between its
    decodes at two contexts. A group no step measures keeps 1."""
    sm = StepModel(model, hw, factors=None)
    terms = {t.name: _terms(sm, t) for t in timed}
    base = next((t.kv_dtype for t in timed if _kind(t) == "prefill"), "f32")
    single = sorted((t for t in timed if _kind(t) == "decode" and len(t.work) == 1
                     and t.kv_dtype == base), key=lambda t: t.work[0].start)
    fixed, kv, depths = _fit_single(sm, terms, single, base)
    kv_of = ({t.name: _depth_kv(sm, base, t.work, depths) for t in timed} if depths
             else {t.name: terms[t.name].kv * kv for t in timed})
    batched = [t for t in timed if _kind(t) == "decode" and len(t.work) > 1]
    rest = {t.name: t.seconds - fixed * terms[t.name].fixed - kv_of[t.name] for t in timed}
    batch = _ratio([(terms[t.name].batch, rest[t.name]) for t in batched])
    sizes = sorted({len(t.work) for t in batched})
    batch_sizes = tuple((float(n), _ratio([(terms[t.name].batch, rest[t.name])
                                            for t in batched if len(t.work) == n]))
                        for n in sizes) if len(sizes) > 1 else ()
    prefill, attention, prefill_sizes = _fit_prefill(
        terms, rest, [t for t in timed if _kind(t) == "prefill"])
    kv_by_dtype = {base: kv}
    for dtype in dict.fromkeys(t.kv_dtype for t in timed if t.kv_dtype != base):
        kv_by_dtype[dtype] = _slope([(terms[t.name].kv, t.seconds - fixed * terms[t.name].fixed)
                                     for t in timed if t.kv_dtype == dtype])
    factors = StepFactors(fixed, kv_by_dtype, batch, prefill, attention, model=name,
                          noise=max((t.spread for t in timed), default=0.0),
                          kv_depths={base: depths} if depths else {},
                          batch_sizes=batch_sizes, prefill_sizes=prefill_sizes)
    points = tuple({"name": t.name, "seconds": t.seconds, "spread": t.spread,
                    "fitted": _fitted(model, hw, factors, t), "kernels": terms[t.name].total}
                   for t in timed)
    return replace(factors, points=points)


def _fit_prefill(terms: Mapping[str, StepTerms], rest: Mapping[str, float],
                 chunks: Sequence[TimedStep]
                 ) -> tuple[float, float, tuple[tuple[float, float], ...]]:
    """(prefill, attention, prefill factor by chunk length) from prefill chunks, past the
    fixed and KV terms (`rest`): both factors by least squares over the longest chunks
    where two or more were timed (over every chunk otherwise); then, with that attention
    factor, a prefill factor of its own for each chunk length timed."""
    length = {t.name: sum(w.tokens for w in t.work if w.tokens > 1) for t in chunks}
    longest = [t for t in chunks if length[t.name] == max(length.values())]
    fit = longest if len(longest) > 1 else chunks
    prefill, attention = _least_squares(
        [(terms[t.name].prefill, terms[t.name].attention, rest[t.name]) for t in fit],
        (1.0, 1.0))
    lengths = sorted(set(length.values()))
    if len(longest) < 2 or len(lengths) < 2:
        return prefill, attention, ()
    sizes = tuple((float(n), _ratio([(terms[t.name].prefill,
                                      rest[t.name] - attention * terms[t.name].attention)
                                     for t in chunks if length[t.name] == n]))
                  for n in lengths)
    return prefill, attention, sizes


_DEPTH_ROUNDS = 4  # the depth factors and the fixed factor, refitted in turn: they converge


def _fit_single(sm: StepModel, terms: Mapping[str, StepTerms], single: Sequence[TimedStep],
                kv_dtype: str) -> tuple[float, float, tuple[tuple[float, float], ...]]:
    """(fixed, KV factor, KV factors by depth) from single decodes in rising depth: both by
    least squares; from three depths or more, the fixed factor from the shortest decode
    and a KV factor per stretch of depth, in turn until they settle."""
    fixed, kv = _least_squares([(terms[t.name].fixed, terms[t.name].kv, t.seconds)
                                for t in single], (1.0, 1.0), KV_FACTOR_RANGE)
    depths: tuple[tuple[float, float], ...] = ()
    if len({t.work[0].start for t in single}) < 3:
        return fixed, kv, depths
    short = single[0]
    for _ in range(_DEPTH_ROUNDS):
        depths = _depth_factors(sm, kv_dtype, single, fixed)
        kv_short = _depth_kv(sm, kv_dtype, short.work, depths)
        fixed = _clamp((short.seconds - kv_short) / terms[short.name].fixed)
    return fixed, depths[0][1], depths


def _depth_kv(sm: StepModel, kv_dtype: str, work: Sequence[SeqWork],
              depths: Sequence[tuple[float, float]]) -> float:
    sm.kv_dtype = kv_dtype
    try:
        return sum(sm.depth_kv_seconds(w.start + 1, depths) for w in work if w.tokens == 1)
    finally:
        sm.kv_dtype = "f32"


def _depth_factors(sm: StepModel, kv_dtype: str, single: Sequence[TimedStep], fixed: float
                   ) -> tuple[tuple[float, float], ...]:
    """(context, KV factor) of each stretch between consecutive single decodes timed at
    rising depths (three or more), past what `fixed` explains; the first stretch from 0."""
    sm.kv_dtype = kv_dtype
    try:
        out = []
        for lo, hi in pairwise(single):
            a, b = lo.work[0].start + 1, hi.work[0].start + 1
            if b <= a:
                continue
            fixed_gap = fixed * (sm.terms(hi.work).fixed - sm.terms(lo.work).fixed)
            kv_gap = sm.kv_seconds(b) - sm.kv_seconds(a)
            factor = (hi.seconds - lo.seconds - fixed_gap) / kv_gap if kv_gap > 0 else 1.0
            out.append((float(b), _clamp(factor, KV_FACTOR_RANGE)))
        return tuple(out)
    finally:
        sm.kv_dtype = "f32"


def _fitted(model: ModelSpec, hw: HardwareSpec, factors: StepFactors, t: TimedStep) -> float:
    return StepModel(model, hw, t.kv_dtype, factors).seconds(t.work)


def _terms(sm: StepModel, t: TimedStep) -> StepTerms:
    sm.kv_dtype = t.kv_dtype
    try:
        return sm.terms(t.work)
    finally:
        sm.kv_dtype = "f32"


def _kind(t: TimedStep) -> str:
    return "prefill" if any(w.tokens > 1 for w in t.work) else "decode"


def _clamp(x: float, bounds: tuple[float, float] = FACTOR_RANGE) -> float:
    lo, hi = bounds
    return float(min(max(x, lo), hi)) if np.isfinite(x) else 1.0


def _ratio(pairs: Sequence[tuple[float, float]],
           bounds: tuple[float, float] = FACTOR_RANGE) -> float:
    """The factor f of least squares for measured ~= f x term; 1 without data."""
    den = sum(term * term for term, _ in pairs)
    return _clamp(sum(term * y for term, y in pairs) / den, bounds) if den > 0 else 1.0


def _slope(pairs: Sequence[tuple[float, float]]) -> float:
    """The factor f of measured ~= c + f x term, c free (the level of a busier moment):
    from two or more steps at different contexts; from one, as `_ratio`."""
    if len(pairs) < 2:
        return _ratio(pairs, KV_FACTOR_RANGE)
    x, y = np.array(pairs, dtype=float).T
    dx = x - x.mean()
    den = float(dx @ dx)
    return _clamp(float(dx @ (y - y.mean())) / den, KV_FACTOR_RANGE) if den > 0 else 1.0


def _least_squares(rows: Sequence[tuple[float, float, float]], default: tuple[float, float],
                   b_bounds: tuple[float, float] = FACTOR_RANGE) -> tuple[float, float]:
    """(a, b) of least squares for y ~= a x1 + b x2 over `rows` (x1, x2, y); where the two
    columns can not be told apart, one shared factor; `default` without rows."""
    if not rows:
        return default
    x = np.array([[r[0], r[1]] for r in rows], dtype=float)
    y = np.array([r[2] for r in rows], dtype=float)
    if len(rows) >= 2 and np.linalg.matrix_rank(x, tol=1e-9 * float(np.abs(x).max())) == 2:
        a, b = np.linalg.lstsq(x, y, rcond=None)[0]
        if FACTOR_RANGE[0] <= a <= FACTOR_RANGE[1] and b_bounds[0] <= b <= b_bounds[1]:
            return float(a), float(b)
    shared = _ratio([(float(x1 + x2), float(yi)) for (x1, x2), yi in zip(x, y)])
    return shared, shared


def median_spread(samples: Sequence[float]) -> tuple[float, float]:
    """(median, interquartile range / median) of repeated timings."""
    arr = np.asarray(samples, dtype=float)
    med = float(np.median(arr))
    q1, q3 = np.percentile(arr, [25, 75])
    return med, float((q3 - q1) / med) if med > 0 else 0.0


def factors_from_dict(data: Mapping[str, object]) -> StepFactors:
    """StepFactors from its JSON form (the probe cache)."""
    d = dict(data)
    d["points"] = tuple(d.get("points") or ())  # type: ignore[arg-type]
    d["kv_depths"] = {dtype: tuple(map(tuple, pts))  # type: ignore[union-attr]
                      for dtype, pts in (d.get("kv_depths") or {}).items()}
    for key in ("batch_sizes", "prefill_sizes"):
        d[key] = tuple(map(tuple, d.get(key) or ()))  # type: ignore[arg-type]
    return StepFactors(**d)  # type: ignore[arg-type]
