"""Text for people: the estimate as a terminal report, the hardware table, and
prediction-against-measurement side by side (`compare`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvlab.estimate.hardware import GB, GIB, TERA, HardwareSpec
from kvlab.estimate.roofline import Estimate
from kvlab.estimate.verdict import error_percent

_BATCH_ROWS_PAST_FIT = 1  # rows of the batch table shown after the first that does not fit


@dataclass(frozen=True)
class Measurement:
    """Figures a run measured; leave out what was not measured."""

    ttft: float | None = None  # seconds
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None  # per stream
    total_seconds: float | None = None
    aggregate_tok_s: float | None = None  # all streams together


def format_estimate(e: Estimate) -> str:
    """The whole estimate as an aligned, plain-text report."""
    sections = [_header(e), _prefill_lines(e), _decode_lines(e), _memory_lines(e),
                _batch_lines(e), _context_lines(e), _offload_lines(e), _note_lines(e)]
    return "\n".join(line for section in sections for line in section) + "\n"


def _header(e: Estimate) -> list[str]:
    m, hw, wl = e.model, e.hardware, e.workload
    s = m.summary()
    layers = f"{m.n_layers} layers" if m.layers_known else "layers unknown"
    window = (f", sliding window {s['sliding_window']} on {s['sliding_layers']} of "
              f"{m.n_layers} layers" if s["sliding_window"] else "")
    embedding = f" (embedding {m.embedding_share:.1%})" if m.lookup_params else ""
    routed = (f"          {m.experts_used} of {m.experts} experts per token: "
              f"{_count(m.active_params)} params active" if m.experts else "")
    return [
        (f"model     {m.name}: {_count(m.n_params)} params{embedding}, "
         f"{_dec(m.weight_bytes, 'B')} of weights, {s['bits_per_param']:.2f} bits/param"),
        *([routed] if routed else []),
        f"          {layers}, {_kv_per_token(e)}{window}",
        (f"hardware  {hw.name}: {hw.bandwidth / GB:,.1f} GB/s, "
         f"{hw.flop_rate(e.compute_dtype) / TERA:,.2f} TFLOPS {e.compute_dtype} sustained, "
         f"memory {_gib_or_unknown(hw.memory_bytes)}"),
        f"          source: {hw.sources.get('bandwidth', '?')}",
        (f"workload  prompt {wl.prompt_tokens:,}, output {wl.output_tokens:,}, concurrency "
         f"{wl.concurrency}, context {wl.context_tokens:,}, KV {wl.kv_dtype}"), ""]


def _kv_per_token(e: Estimate) -> str:
    """KV per token; with sliding layers, split into what grows and what the windows fix."""
    full, fixed = e.model.kv_split(e.workload.kv_bytes_per_element)
    if e.state_bytes_per_seq:  # a hybrid: KV in the attention layers, a state in the others
        return (f"KV {_kib(full)}/token {e.workload.kv_dtype} in the attention layers + "
                f"{_binary(e.state_bytes_per_seq)} fp32 state per sequence in "
                f"{e.model.recurrent_layers} recurrent layers")
    if not fixed:
        return f"KV {_kib(e.kv_bytes_per_token)}/token {e.workload.kv_dtype}"
    return (f"KV {_kib(full)}/token {e.workload.kv_dtype} in full-attention layers + "
            f"{_binary(fixed)} fixed in the windows")


def _prefill_lines(e: Estimate) -> list[str]:
    return [
        (f"prefill   {_dec(e.prefill_flop_per_token, 'FLOP')}/token x {e.workload.prompt_tokens:,}"
         f" = {_dec(e.prefill_flop, 'FLOP')} -> {_secs(e.prefill_seconds)} ({e.prefill_bound}-"
         f"bound), {e.prefill_tok_s:,.0f} tok/s"),
        f"TTFT      {_secs(e.ttft)}", ""]


def _decode_lines(e: Estimate) -> list[str]:
    lo, hi = e.decode_tok_s_realistic
    tlo, thi = e.total_seconds_range
    return [
        (f"decode    reads {_dec(e.decode_weight_bytes, 'B')} of weights + "
         f"{_dec(e.decode_kv_read_bytes, 'B')} of KV per sequence a step"
         + (f" + its {_dec(e.state_bytes_per_seq, 'B')} state read and written"
            if e.state_bytes_per_seq else "") + f" ({e.decode_bound}-bound)"),
        (f"          ceiling {e.decode_tok_s_ceiling:,.1f} tok/s per stream (weights alone: "
         f"{e.weights_only_tok_s:,.1f}); realistic {lo:,.1f}-{hi:,.1f} tok/s "
         f"({e.workload.efficiency[0]:.0%}-{e.workload.efficiency[1]:.0%})"),
        (f"total     TTFT + {max(e.workload.output_tokens - 1, 0):,} steps = "
         f"{_secs(e.total_seconds)} ({_secs(tlo)}-{_secs(thi)})"), ""]


def _memory_lines(e: Estimate) -> list[str]:
    wl = e.workload
    kv = (f"KV {_binary(e.kv_bytes)} for {wl.context_tokens:,} tokens x {wl.concurrency} "
          f"sequence{'s' if wl.concurrency > 1 else ''}"
          + (f" + states {_binary(e.state_bytes)}" if e.state_bytes else ""))
    if e.memory_usable is None:
        return [f"memory    {kv}; memory size unknown, fit not checked", ""]
    verdict = "fits" if e.fits else "DOES NOT FIT"
    conc = "no KV limit" if e.max_concurrency is None else f"{e.max_concurrency:,}"
    ctx = "no KV limit" if e.max_context is None else f"{e.max_context:,}"
    return [
        (f"memory    needs {_binary(e.memory_needed)} ({kv}) of {_gib(e.memory_usable)} usable "
         f"({wl.usable_memory:.0%}): {verdict}"),
        (f"          largest concurrency at context {wl.context_tokens:,}: {conc}; "
         f"largest context at concurrency {wl.concurrency}: {ctx}"), ""]


def _batch_lines(e: Estimate) -> list[str]:
    turn = ("bandwidth-bound at every batch" if e.compute_bound_batch is None
            else f"compute-bound from batch {e.compute_bound_batch:,}")
    lines = [f"batching  decode ceiling by batch size ({turn}, mid-reply)",
             "          batch   total tok/s   per stream   bound     fits"]
    past_fit = 0
    for p in e.batch_sweep:
        if p.fits is False:
            past_fit += 1
            if past_fit > _BATCH_ROWS_PAST_FIT:
                break
        lines.append(f"          {p.batch:>5}  {p.aggregate_tok_s:>12,.1f}  "
                     f"{p.per_stream_tok_s:>11,.1f}   {p.bound:<8}  {_yes_no(p.fits)}")
    return lines + [""]


def _context_lines(e: Estimate) -> list[str]:
    lines = [(f"context   decode ceiling per stream by context (concurrency "
              f"{e.workload.concurrency})"),
             "          context   tok/s     KV/sequence   fits"]
    points = e.context_sweep
    for p in points[::max(len(points) // 8, 1)] + (points[-1],):
        lines.append(f"          {p.context:>7,}  {p.tok_s:>8,.1f}   {_binary(p.kv_bytes):>11}   "
                     f"{_yes_no(p.fits)}")
    return _dedupe(lines) + [""]


def _offload_lines(e: Estimate) -> list[str]:
    o = e.offload
    if o is None:
        return []
    return [(f"offload   {o.layers} layers at {o.bandwidth / GB:,.1f} GB/s: "
             f"{_dec(o.slow_bytes_per_step, 'B')} per step from slow memory; decode "
             f"{o.tok_s_without:,.1f} -> {o.tok_s_with:,.1f} tok/s "
             f"({o.tok_s_without / o.tok_s_with:.2f}x slower), {_binary(o.fast_memory_saved)} "
             "freed in fast memory"), ""]


def _note_lines(e: Estimate) -> list[str]:
    return [f"note      {n}" for n in e.notes]


def format_hardware_table(parts: Iterable[HardwareSpec]) -> str:
    """`--list-hardware`: name, bandwidth, sustained FLOP/s, memory, bandwidth source."""
    lines = [f"{'name':<17} {'GB/s':>7} {'TFLOPS':>8} {'dtype':<5} {'GiB':>5}  part"]
    for hw in parts:
        tflops = hw.flop_rate() / TERA
        lines.append(f"{hw.key:<17} {hw.bandwidth / GB:>7,.0f} {tflops:>8,.1f} "
                     f"{hw.default_dtype:<5} {_gib_or_unknown(hw.memory_bytes, unit=False):>5}  "
                     f"{hw.name}")
    lines.append("TFLOPS: sustained, at the part's default dtype; sources: --json")
    return "\n".join(lines) + "\n"


# -- prediction against measurement ----------------------------------------------------------


def compare(predicted: Estimate, measured: Measurement | Mapping[str, float]) -> str:
    """Prediction, measurement and error % side by side, one row per measured figure."""
    m = measured if isinstance(measured, Measurement) else Measurement(**dict(measured))
    e, eff = predicted, predicted.workload.efficiency
    rows: list[tuple[str, str, float | None, float | None, tuple[float, float] | None]] = [
        ("TTFT", "s", e.ttft, m.ttft, None),
        ("prefill", "tok/s", e.prefill_tok_s, m.prefill_tok_s, None),
        ("decode", "tok/s", e.decode_tok_s_mid, m.decode_tok_s, e.decode_tok_s_realistic),
        ("total", "s", e.total_seconds, m.total_seconds, e.total_seconds_range),
        ("aggregate", "tok/s", e.decode_tok_s_mid * e.workload.concurrency, m.aggregate_tok_s,
         (e.aggregate_tok_s_ceiling * eff[0], e.aggregate_tok_s_ceiling * eff[1])),
    ]
    lines = [f"{'metric':<18} {'predicted':>10} {'range':>19} {'measured':>10} {'error %':>8}"]
    for name, unit, pred, meas, span in rows:
        if meas is None:
            continue
        lines.append(_compare_row(f"{name} ({unit})", pred, meas, span))
    lines += _achieved_lines(e, m)
    return "\n".join(lines) + "\n"


def _compare_row(label: str, pred: float | None, meas: float,
                 span: tuple[float, float] | None) -> str:
    error = error_percent(pred, meas)
    span_text = f"{_num(span[0])}-{_num(span[1])}" if span else ""
    verdict = ""
    if span:
        verdict = "in range" if span[0] <= meas <= span[1] else (
            "below range" if meas < span[0] else "above range")
    return (f"{label:<18} {_num(pred):>10} {span_text:>19} {_num(meas):>10} {error:>+7.1f}%"
            f"  {verdict}").rstrip()


def _achieved_lines(e: Estimate, m: Measurement) -> list[str]:
    """What the measured run reached against the machine's ceilings."""
    lines = []
    if m.decode_tok_s:
        per_step = e.decode_weight_bytes / e.workload.concurrency + e.decode_kv_read_bytes
        achieved = m.decode_tok_s * e.workload.concurrency * per_step / GB
        lines.append(f"decode reached {achieved:,.1f} GB/s of {e.hardware.bandwidth / GB:,.1f} "
                     f"({m.decode_tok_s / e.decode_tok_s_ceiling:.0%} of the ceiling)")
    if m.ttft:
        rate = e.prefill_flop / m.ttft / TERA
        lines.append(f"prefill reached {rate:,.3f} TFLOPS of "
                     f"{e.hardware.flop_rate(e.compute_dtype) / TERA:,.3f} {e.compute_dtype}")
    return lines


# -- units -----------------------------------------------------------------------------------


def _dec(value: float, unit: str) -> str:
    """Decimal prefixes, as bandwidth and FLOP are quoted: 246.6 MB, 64.0 TFLOP."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.1f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def _count(value: float) -> str:
    return _dec(value, "").rstrip()


def _kib(value: float) -> str:
    return f"{value / 1024:,.1f} KiB"


def _binary(value: float) -> str:
    """Binary prefixes, as memory is sized: 7.5 MiB, 1.25 GiB."""
    for prefix, scale in (("Gi", GIB), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {prefix}B"
    return f"{value:,.0f} B"


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def _gib_or_unknown(value: float | None, unit: bool = True) -> str:
    if value is None:
        return "unknown" if unit else "?"
    return _gib(value) if unit else f"{value / GIB:,.0f}"


def _secs(value: float) -> str:
    return f"{value:,.2f} s" if value >= 0.1 else f"{value * 1000:,.1f} ms"


def _num(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _dedupe(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))
