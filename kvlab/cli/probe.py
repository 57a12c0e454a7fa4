"""`kvlab probe`: measure this machine's memory bandwidth and matmul FLOP/s, how fast
kvlab's own kernels and engine run here, and whole engine steps on a replica of a model
(random weights, the model's sizes and types: the default model unless --model names a
GGUF file), and cache them for `kvlab estimate --hardware this`, `kvlab bench --estimate`
and `kvlab loadtest --estimate`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.estimate.hardware import KernelRates, StepFactors, StreamCosts
from kvlab.probe.cache import save_probe
from kvlab.probe.machine import probe


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "probe", help="measure memory bandwidth and FLOP/s for `estimate --hardware this`",
        description=__doc__)
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch threads to measure with (default: torch's own choice)")
    p.add_argument("--bf16", action="store_true", help="also measure bf16 matmul FLOP/s")
    p.add_argument("--model", metavar="FILE.gguf",
                   help="the model whose replica's steps are timed (default: the default model)")
    p.add_argument("--no-steps", action="store_true",
                   help="skip the whole-step timings and serving (about 90 s)")
    p.add_argument("--no-serving", action="store_true",
                   help="skip timing kvlab serve streaming the replica (about 30 s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.model is not None and not Path(args.model).is_file():
        raise KvlabError(f"--model {args.model}: no such file (a GGUF model is expected)")
    result = probe(threads=args.threads, bf16=args.bf16, model=args.model,
                   steps=not args.no_steps, serving=not args.no_serving)
    path = save_probe(result)
    if args.json:
        print(json.dumps({**asdict(result), "cache": str(path)}, indent=2))
        return 0
    print(f"probed {result.cpu} with {result.threads} threads")
    rows = [("memory read bandwidth", f"{result.bandwidth_gbs:,.1f} GB/s",
             result.details["bandwidth"])]
    rows += [(f"matmul {dtype}", f"{tf * 1000:,.1f} GFLOP/s", result.details[dtype])
             for dtype, tf in result.tflops.items()]
    rows.append(("memory", f"{result.memory_gib:,.1f} GiB", result.details["memory"]))
    rows += _kernel_rows(result.kernel_rates())
    for name, value, how in rows:
        print(f"{name:<22} {value:>15}   {how}")
    if "steps" in result.details:
        print(f"whole steps            {result.details['steps']}")
        print(_step_lines(result.step_factors()))
    if "stream" in result.details:
        print(f"serving                {result.details['stream']}")
        print(_stream_lines(result.stream_costs()))
    print(f"cached to {path} for `kvlab estimate --hardware this`")
    return 0


def _step_lines(f: StepFactors | None) -> str:
    """Each timed step against the step model before and after the fit, then the factors."""
    if f is None:
        return ""
    lines = [f"  {'step':<26} {'median':>10} {'IQR/med':>8} {'kernels':>10} {'fitted':>10}"]
    for p in f.points:
        lines.append(f"  {p['name']:<26} {p['seconds'] * 1e3:>8.2f}ms {p['spread']:>8.1%} "
                     f"{p['kernels'] * 1e3:>8.2f}ms {p['fitted'] * 1e3:>8.2f}ms")
    kv = ", ".join(f"{d} {v:.2f}" for d, v in f.kv.items())
    for dtype, depths in f.kv_depths.items():
        kv += f"; {dtype} by depth " + ", ".join(f"to {c:.0f} {v:.2f}" for c, v in depths)
    if f.batch_sizes:
        kv += "; batch by size " + ", ".join(f"{n:.0f} {v:.2f}" for n, v in f.batch_sizes)
    if f.prefill_sizes:
        kv += "; prefill by chunk " + ", ".join(f"{n:.0f} {v:.2f}" for n, v in f.prefill_sizes)
    lines.append(f"  factors over the kernel rates: fixed {f.fixed:.2f}, batch {f.batch:.2f}, "
                 f"prefill {f.prefill:.2f}, prefill attention {f.prefill_attention:.2f}, "
                 f"KV {kv}; noise: the steps' repeats spread up to {f.noise:.0%} (IQR/median)")
    return "\n".join(lines)


def _stream_lines(s: StreamCosts | None) -> str:
    """Each load against its prediction with the costs fitted to them, then the costs."""
    if s is None:
        return ""
    lines = [f"  {'streams':>7} {'ITL p50':>9} {'fitted':>9} {'TTFT p50':>9} {'fitted':>9}"]
    for lv in s.levels:
        lines.append(f"  {lv['concurrency']:>7} {lv['itl_p50'] * 1e3:>7.2f}ms "
                     f"{lv['predicted_itl_p50'] * 1e3:>7.2f}ms {lv['ttft_p50'] * 1e3:>7.1f}ms "
                     f"{lv['predicted_ttft_p50'] * 1e3:>7.1f}ms")
    lines.append(f"  besides the steps: {s.token * 1e3:.2f} ms a streamed token, "
                 f"{s.step * 1e3:.2f} ms a step, {s.request * 1e3:.1f} ms a request "
                 f"({s.intake * 1e3:.1f} ms of it one request at a time)")
    return "\n".join(lines)


def _kernel_rows(k: KernelRates | None) -> list[tuple[str, str, str]]:
    """kvlab's own kernels and engine, as `kvlab bench --estimate` predicts from them."""
    if k is None:
        return [("kvlab kernels", "-", "not measured (kvlab's C kernels are not built)")]
    reads = ", ".join(f"{t} {r / 1e9:.0f}" for t, r in sorted(k.weight_read.items(),
                                                               key=lambda kv: -kv[1]))
    prefill = ", ".join(f"{t} {r / 1e9:.0f}" for t, r in sorted(k.prefill_ops.items(),
                                                                key=lambda kv: -kv[1]))
    rows = [("decode weight read", f"{max(k.weight_read.values()) / 1e9:,.1f} GB/s",
             f"batch-1 products by type (GB/s): {reads}"),
            ("product call", f"{k.call_seconds * 1e6:,.1f} us",
             "per call, besides its bytes (a fresh small matrix)"),
            ("prefill products", f"{max(k.prefill_ops.values()) / 1e9:,.0f} GOP/s",
             f"512 rows, by type: {prefill}"),
            ("decode attention", f"{k.attention_read / 1e9:,.1f} GB/s",
             (f"f32 K/V read; {k.attention_read_strided / 1e9:.1f} GB/s with 8 "
              "KV heads a row")),
            ("sampling", f"{k.logit_seconds * 1e9:,.2f} ns", "per vocabulary entry, greedy")]
    if k.spread:
        worst = max(k.spread, key=lambda name: k.spread[name])
        rows.append(("kernel noise", f"{sorted(k.spread.values())[len(k.spread) // 2]:.1%}",
                     (f"median IQR/median of the kernel timers' rounds; the worst: {worst} "
                     f"{k.spread[worst]:.0%}")))
    for arch in sorted(k.layer_seconds):
        step, layer, position = k.engine(arch)
        rows.append((f"engine ({arch})", f"{layer * 1e6:,.0f} us/layer",
                     (f"+ {step * 1e6:,.0f} us/step + {position * 1e9:,.0f} ns per attended "
                      "position, besides products and attention")))
    return rows
