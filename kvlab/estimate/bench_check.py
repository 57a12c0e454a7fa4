"""kvlab's predictions against the figures a `kvlab bench` run measured: for each figure,
the step model's prediction (kvlab's own kernels and engine at the rates `kvlab probe`
measured), the roofline's beside it, where the predicted time goes, and for a figure more
than `TOLERANCE` off what the run must have reached for the dominant term to account for the
difference. Nothing from the run enters a prediction; the CLI prints what this returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvlab.cost import ModelSpec
from kvlab.estimate.hardware import GB, HardwareSpec
from kvlab.estimate.kernel_steps import KvlabPrediction, shares_text
from kvlab.estimate.roofline import Estimate, estimate
from kvlab.estimate.specs import spec_from_gguf, spec_from_hf_config
from kvlab.estimate.step_model import describe_factors, predict
from kvlab.estimate.verdict import error_percent, misses
from kvlab.estimate.workload import Workload

KV_DTYPE = "f32"  # the KV cache predicted where the run's is not given
TOLERANCE = 0.25  # the aim: every prediction within 25 % of the measurement


class BenchFigure(Protocol):
    """One measured llama-bench-style test (kvlab.harness.llama_bench.BenchResult)."""

    test: str  # "pp512", "tg128", ...
    n_prompt: int
    n_gen: int
    depth: int
    tok_s_mean: float
    tok_s_std: float
    samples: list[float]


@dataclass(frozen=True)
class CheckRow:
    figure: str
    predicted: float
    measured: float
    roofline: float  # the generic roofline's prediction, for comparison
    terms: str  # where the predicted time goes
    miss: str  # why it is off, when it is off by more than TOLERANCE

    @property
    def error(self) -> float:
        """Measured against predicted, in percent."""
        return error_percent(self.predicted, self.measured) if self.predicted else 0.0


def bench_model(path: str) -> ModelSpec:
    p = Path(path)
    return spec_from_hf_config(p / "config.json") if p.is_dir() else spec_from_gguf(p)


def _workload(prompt: int, output: int, compute_dtype: str | None = None,
              kv_dtype: str = KV_DTYPE) -> Workload:
    return Workload(prompt_tokens=prompt, output_tokens=output, kv_dtype=kv_dtype,
                    compute_dtype=compute_dtype)


def check_rows(model: ModelSpec, hw: HardwareSpec, results: Sequence[BenchFigure],
               compute_dtype: str | None = None) -> list[tuple[str, float, float]]:
    """(figure, predicted, measured) by the roofline alone, for every measured figure plus
    TTFT and response time (the generic path; `kvlab_rows` is kvlab's own)."""
    rows: list[tuple[str, float, float]] = []
    for figure, (prompt, output), measured, pick in _figures(results):
        e = estimate(model, hw, _workload(prompt, output, compute_dtype))
        rows.append((figure, pick.roofline(e), measured))
    return rows


def kvlab_rows(model: ModelSpec, hw: HardwareSpec, results: Sequence[BenchFigure],
               compute_dtype: str | None = None, kv_dtype: str = KV_DTYPE) -> list[CheckRow]:
    """kvlab's step model against every measured figure (the run's KV cache at `kv_dtype`),
    with the roofline beside it."""
    rows = []
    for figure, (prompt, output), measured, pick in _figures(results):
        p = predict(model, hw, _workload(prompt, output, kv_dtype=kv_dtype))
        e = estimate(model, hw, _workload(prompt, output, compute_dtype))
        value = pick.kvlab(p)
        rows.append(CheckRow(figure, value, measured, pick.roofline(e), pick.terms(p),
                             pick.miss(p, measured) if misses(value, measured, TOLERANCE) else ""))
    return rows


_ROOFLINE_FIELDS = {"prefill": "prefill_tok_s", "ttft": "ttft", "decode": "decode_tok_s_mid",
                    "total": "total_seconds"}


class _Figure:
    """How one kind of figure is read from a prediction, and explained."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "prefill", "ttft", "decode", "total"

    def kvlab(self, p: KvlabPrediction) -> float:
        return {"prefill": p.prefill_tok_s, "ttft": p.ttft, "decode": p.decode_tok_s,
                "total": p.total_seconds}[self.kind]

    def roofline(self, e: Estimate) -> float:
        return float(getattr(e, _ROOFLINE_FIELDS[self.kind]))

    def terms(self, p: KvlabPrediction) -> str:
        if self.kind in ("prefill", "ttft"):
            return shares_text(p.prefill.shares())
        if self.kind == "decode":
            d = p.decode
            return (f"{shares_text(d.shares())} of a {d.total * 1e3:.2f} ms step "
                    f"(KV {p.decode_first.kv * 1e3:.2f}-{p.decode_last.kv * 1e3:.2f} ms)")
        n = max(p.workload.output_tokens - 1, 0)
        return shares_text({"prefill": p.ttft / p.total_seconds,
                            f"{n} decode steps": n * p.decode.total / p.total_seconds})

    def miss(self, p: KvlabPrediction, measured: float) -> str:
        """What the run must have reached, were the dominant term alone to blame."""
        if self.kind == "total":
            return "follows from the prefill and decode rows above"
        if self.kind == "decode":
            seconds, terms = 1 / measured, {"weights": p.decode.weights, "KV": p.decode.kv,
                                            "overhead": p.decode.overhead}
        else:
            seconds = p.workload.prompt_tokens / measured if self.kind == "prefill" else measured
            terms = {"matmul": p.prefill.matmul, "attention": p.prefill.attention,
                     "element-wise": p.prefill.row_ops}
        name, predicted = max(terms.items(), key=lambda kv: kv[1])
        rest = sum(terms.values()) - predicted
        if self.kind != "decode":
            rest += p.prefill.first_token
        factor = predicted / max(seconds - rest, 1e-9)
        return (f"{_WHAT[name]} at {factor:.0%} of the probed speed, were they alone to blame; "
                "other work sharing the cores during the bench, or a probe taken in a quieter "
                "moment, moves every figure this way")


_WHAT = {"weights": "the products read weights", "KV": "decode attention read the KV cache",
         "overhead": "the engine's per-layer calls ran", "matmul": "the integer products ran",
         "attention": "prefill attention ran", "element-wise": "the element-wise passes ran"}


def _figures(results: Sequence[BenchFigure]
             ) -> list[tuple[str, tuple[int, int], float, _Figure]]:
    """(figure, (prompt, output) to predict, measured value, how to read it)."""
    out = []
    pp = [r for r in results if r.n_prompt]
    tg = [r for r in results if r.n_gen]
    for r in pp:
        out.append((f"{r.test} prefill tok/s", (r.n_prompt, 1), r.tok_s_mean, _Figure("prefill")))
        out.append((f"TTFT, {r.n_prompt}-token prompt (s)", (r.n_prompt, 1),
                    r.n_prompt / r.tok_s_mean, _Figure("ttft")))
    for r in tg:
        out.append((f"{r.test} decode tok/s", (max(1, r.depth), r.n_gen), r.tok_s_mean,
                    _Figure("decode")))
    if pp and tg:
        p, n = pp[0], next((r for r in tg if r.depth == 0), tg[0])
        measured = p.n_prompt / p.tok_s_mean + (n.n_gen - 1) / n.tok_s_mean
        out.append((f"response, {p.n_prompt} in + {n.n_gen} out (s)", (p.n_prompt, n.n_gen),
                    measured, _Figure("total")))
    return out


NOISY = 0.10  # a bench figure whose runs spread more than this is noted


def notes(results: Sequence[BenchFigure], rows: list[CheckRow],
           hw: HardwareSpec | None = None) -> list[str]:
    """Where the measurement itself is uncertain, a bias shared by all decode figures, and
    what the step model leaves out."""
    notes = []
    for r in results:
        if r.tok_s_mean and r.tok_s_std > NOISY * r.tok_s_mean:
            runs = ", ".join(f"{s:.1f}" for s in r.samples)
            notes.append(f"{r.test}: its runs spread +-{r.tok_s_std / r.tok_s_mean:.0%} "
                         f"({runs} tok/s): other work on this machine slowed some of them")
    decode = [r.error for r in rows if r.figure.endswith("decode tok/s")]
    if len(decode) > 1 and (max(decode) < 0 or min(decode) > 0):
        side = "below" if max(decode) < 0 else "above"
        why = ("other work on the cores during the bench, or a probe taken in a quieter "
               "moment" if side == "below" else "the probe ran in a busier moment than the bench")
        notes.append(f"decode: all {len(decode)} figures {side} the prediction "
                     f"({min(decode):+.0f} to {max(decode):+.0f} %): {why}")
    if hw is not None:
        notes.append(describe_factors(hw.steps))
    notes.append("not modelled: other work sharing the cores while the bench runs (the probe's "
                 "medians hold for a machine as busy as during the probe)")
    return notes


def verdict(rows: list[CheckRow]) -> str:
    missed = [r for r in rows if r.miss]
    if not missed:
        return f"\nevery figure within {TOLERANCE:.0%} of the prediction"
    return f"\n{len(missed)} of {len(rows)} figures more than {TOLERANCE:.0%} off:"


def header(hw: HardwareSpec, model: ModelSpec) -> str:
    k = hw.kernels
    assert k is not None
    reads = sorted(k.weight_read.values())
    step, layer, _ = k.engine(model.architecture)
    return (f"\nprediction for {hw.name}: kvlab's step model over the probed rates of its own "
            f"kernels (weights {reads[0] / GB:.0f}-{reads[-1] / GB:.0f} GB/s by type, decode "
            f"attention {k.attention_read / GB:.1f} GB/s, engine "
            f"{layer * 1e6:.0f} us/layer + {step * 1e6:.0f} us/step); roofline: "
            f"{hw.bandwidth / GB:.1f} GB/s stream read x 60-85 %")
