"""`kvlab bench --estimate`: the estimator's prediction for this machine beside each figure
`kvlab bench` measured, with the error in percent (kvlab.estimate.bench_check computes the
rows; this module resolves this machine's probe and prints them).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.bench_check import (
    KV_DTYPE,
    BenchFigure,
    CheckRow,
    bench_model,
    check_rows,
    header,
    kvlab_rows,
    notes,
    verdict,
)
from kvlab.estimate.hardware import GB, HardwareSpec
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.speculative import SpecRun, check_run
from kvlab.estimate.verdict import error_percent
from kvlab.estimate.workload import Workload
from kvlab.probe.cache import PROBE_VERSION, cache_path, read_probe, save_probe
from kvlab.probe.machine import probe


def _hardware(threads: int | None, model_path: str | None = None) -> HardwareSpec:
    """This machine as `kvlab probe` measured it with kvlab's kernel figures and whole
    steps at `threads`; probes now (about a minute, the steps on a replica of
    `model_path`) when the cache lacks them or is for another thread count."""
    try:
        cached = read_probe()
        current = cached.kernels is not None and cached.version == PROBE_VERSION
        if current and threads in (None, cached.threads):
            return cached.to_hardware()
        why = ("has no kernel figures" if cached.kernels is None
               else f"is from an older kvlab (version {cached.version})" if not current
               else f"is for {cached.threads} threads")
    except KvlabError:
        why = "cannot be read" if cache_path().exists() else "is missing"
    print(f"\nthe probe cache {why}: probing this machine (about a minute)")
    gguf = model_path if model_path and Path(model_path).is_file() else None
    save_probe(probe(threads, model=gguf))
    return read_probe().to_hardware()


def print_check(model_path: str, results: list[BenchFigure], threads: int | None,
                quantized: bool, kv_dtype: str = KV_DTYPE,
                speculative: dict[str, SpecRun] | None = None,
                draft_path: str | None = None, method: str | None = None) -> None:
    hw = _hardware(threads, model_path)
    model = bench_model(model_path)
    _print_figures(model, hw, results, quantized, kv_dtype)
    if speculative:
        _print_speculative(model, hw, results, speculative, kv_dtype, draft_path)
        if method == "mtp":
            print("  the MTP layer's own passes are not priced: the prediction takes them as free")


def _print_figures(model: ModelSpec, hw: HardwareSpec, results: list[BenchFigure],
                   quantized: bool, kv_dtype: str) -> None:
    """Every measured figure against kvlab's step model, or the roofline where it does not
    apply."""
    # a quantized model's prefill runs kvlab's integer kernels: their probed rate applies
    dtype = "int8" if quantized and "int8" in hw.flops else None
    reason = unsupported_reason(model, hw) or (
        None if quantized else "the engine runs this model without kvlab's quantized kernels")
    if reason:
        _print_roofline(model, hw, results, dtype, reason)
        return
    rows = kvlab_rows(model, hw, results, dtype, kv_dtype)
    print(header(hw, model))
    _print_rows(rows)
    print("\nnotes")
    for line in notes(results, rows, hw):
        print(f"  {line}")


def _print_speculative(model: ModelSpec, hw: HardwareSpec, results: list[BenchFigure],
                       runs: dict[str, SpecRun], kv_dtype: str, draft_path: str | None) -> None:
    """Each speculative tg test's decode predicted at the acceptance it measured."""
    draft = bench_model(draft_path) if draft_path else None
    print("\nspeculative decode, predicted at each test's measured acceptance (the decode rows "
          "above predict plain decode)")
    for r in results:
        if r.test not in runs:
            continue
        run = runs[r.test]
        workload = Workload(prompt_tokens=max(1, r.depth), output_tokens=r.n_gen,
                            kv_dtype=kv_dtype)
        c = check_run(model, hw, workload, run, draft)
        point = c.estimate.points[0]
        print(f"{r.test} speculative tok/s: predicted {c.tok_s:.3f}, measured "
              f"{r.tok_s_mean:.3f}, error {error_percent(c.tok_s, r.tok_s_mean):+.1f}% "
              f"(k {run.k}, acceptance {run.acceptance:.2f} a token from {run.accepted} of "
              f"{run.drafted} proposed kept; {run.runs} verify steps of "
              f"{point.tokens_per_step:.2f} tokens + {c.plain_steps:.0f} plain; plain decode "
              f"{point.plain_tok_s:.3f}; {c.estimate.source})")


def _print_rows(rows: list[CheckRow]) -> None:
    """The table, where each figure's predicted time goes, and what the misses imply."""
    width = max(len(r.figure) for r in rows)
    print(f"{'figure':<{width}}  {'predicted':>10}  {'measured':>10}  {'error':>7}  "
          f"{'roofline':>10}")
    for r in rows:
        print(f"{r.figure:<{width}}  {r.predicted:>10.3f}  {r.measured:>10.3f}  "
              f"{r.error:>+6.1f}%  {r.roofline:>10.3f}")
    print("\nwhere the predicted time goes")
    for r in rows:
        print(f"  {r.figure:<{width}}  {r.terms}")
    print(verdict(rows))
    for r in rows:
        if r.miss:
            print(f"  {r.figure}: {r.error:+.0f} %: {r.miss}")


def _print_roofline(model: ModelSpec, hw: HardwareSpec, results: list[BenchFigure],
                    dtype: str | None, reason: str) -> None:
    """The generic prediction, when kvlab's own step model does not apply."""
    rows = check_rows(model, hw, results, dtype)
    print(f"\nprediction for {hw.name}: {hw.bandwidth / GB:.1f} GB/s measured by kvlab probe, "
          "decode at the middle of the 60-85 % efficiency range, prefill at the probed "
          f"{dtype or hw.default_dtype} rate ({hw.flop_rate(dtype) / 1e9:.0f} G/s); "
          f"kvlab's step model does not apply: {reason}")
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'predicted':>10}  {'measured':>10}  {'error':>7}")
    for name, pred, meas in rows:
        err = error_percent(pred, meas)
        print(f"{name:<{width}}  {pred:>10.3f}  {meas:>10.3f}  {err:>+6.1f}%")
