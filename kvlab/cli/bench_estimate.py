"""`kvlab bench --estimate`: the estimator's prediction for this machine beside each figure
`kvlab bench` measured, with the error in percent."""

from __future__ import annotations

from pathlib import Path

from kvlab.bench.llama_bench import BenchResult
from kvlab.perf import Estimate, HardwareSpec, ModelSpec, Workload, estimate

KV_DTYPE = "f32"  # what kvlab's CPU engine stores by default


def _hardware(threads: int | None) -> HardwareSpec:
    """This machine as `kvlab probe` measured it; probes now (about 15 s) if never probed."""
    from kvlab.perf.probe import probe, save_probe

    try:
        return HardwareSpec.this_machine()
    except Exception:  # noqa: BLE001 - no cache yet
        save_probe(probe(threads))
        return HardwareSpec.this_machine()


def _model(path: str) -> ModelSpec:
    p = Path(path)
    return ModelSpec.from_hf_config(p / "config.json") if p.is_dir() else ModelSpec.from_gguf(p)


def check_rows(model: ModelSpec, hw: HardwareSpec, results: list[BenchResult],
               compute_dtype: str | None = None) -> list[tuple[str, float, float]]:
    """(figure, predicted, measured) for every measured figure, plus TTFT and response time."""
    rows: list[tuple[str, float, float]] = []

    def estimate_for(prompt: int, output: int) -> Estimate:
        return estimate(model, hw, Workload(prompt_tokens=prompt, output_tokens=output,
                                            kv_dtype=KV_DTYPE, compute_dtype=compute_dtype))

    pp = [r for r in results if r.n_prompt]
    tg = [r for r in results if r.n_gen]
    for r in pp:
        e = estimate_for(r.n_prompt, 1)
        rows.append((f"{r.test} prefill tok/s", e.prefill_tok_s, r.tok_s_mean))
        rows.append((f"TTFT, {r.n_prompt}-token prompt (s)", e.ttft, r.n_prompt / r.tok_s_mean))
    for r in tg:
        e = estimate_for(max(1, r.depth), r.n_gen)
        rows.append((f"{r.test} decode tok/s", e.decode_tok_s_mid, r.tok_s_mean))
    if pp and tg:
        p, n = pp[0], next((r for r in tg if r.depth == 0), tg[0])
        e = estimate_for(p.n_prompt, n.n_gen)
        measured = p.n_prompt / p.tok_s_mean + (n.n_gen - 1) / n.tok_s_mean
        rows.append((f"response, {p.n_prompt} in + {n.n_gen} out (s)", e.total_seconds,
                     measured))
    return rows


def print_check(model_path: str, results: list[BenchResult], threads: int | None,
                quantized: bool) -> None:
    hw = _hardware(threads)
    # a quantized model's prefill runs kvlab's integer kernels: their probed rate applies
    dtype = "int8" if quantized and "int8" in hw.flops else None
    rows = check_rows(_model(model_path), hw, results, dtype)
    print(f"\nprediction for {hw.name}: {hw.bandwidth / 1e9:.1f} GB/s measured by kvlab probe, "
          "decode at the middle of the 60-85 % efficiency range, prefill at the probed "
          f"{dtype or hw.default_dtype} rate ({hw.flop_rate(dtype) / 1e9:.0f} G/s)")
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'predicted':>10}  {'measured':>10}  {'error':>7}")
    for name, pred, meas in rows:
        err = (meas - pred) / pred * 100 if pred else float("nan")
        print(f"{name:<{width}}  {pred:>10.3f}  {meas:>10.3f}  {err:>+6.1f}%")
