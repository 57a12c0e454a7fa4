"""Hybrid models' decode at depth, split by layer kind: does the recurrent share hold?

    .venv/bin/python bench/hybrid_depth.py [--depth 16000] [--models a,b] [-n 64] [-r 3] [-t 2]

A hybrid's recurrent layers (Qwen3.5's Gated DeltaNet, Granite 4 hybrid's Mamba-2, LFM2's
short convolution) read a state of fixed size, so their time per token should not grow with
the context, while its few attention layers read K/V that does: the whole model's tg at depth
over tg at depth 0 mixes the two. Here each model in --workdir (the Q4_K_M files
bench/shapes_vs_llamabench.py builds) decodes in one process at depth 0 and at --depth with
the one-call C decode's profile on (kvlab.harness.decode_split), and prints per layer kind
its ms per decode token at both depths and the ratio of the kind's rate (1 / its time per
token) at depth over depth 0: the recurrent share's against DEPTH_TARGET, the attention
share's for contrast. At depth 0, rounds alternate the profile off and on, one repetition
each, and the median tg of each gives the profile's cost (on / off); the split at depth 0 is
the median of the profiled rounds'. Every tg at --depth prefills that many tokens first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from kvlab.engine import Engine, EngineConfig
from kvlab.harness.decode_split import KINDS, LayerSplit, profiled_tg
from kvlab.harness.llama_bench import bench_tg

MODELS = ("qwen3.5-0.8b", "lfm2-350m", "granite-4.0-h-350m")
DEPTH_TARGET = 0.9  # the recurrent share's tok/s at depth over depth 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated names of {{name}}-{{quant}}.gguf in --workdir "
                         f"(default: {','.join(MODELS)})")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvlab-shapes"))
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--depth", type=int, default=16000, help="context tokens before the tg")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per tg repetition")
    ap.add_argument("-r", type=int, default=3, help="repetitions (rounds at depth 0)")
    ap.add_argument("-t", type=int, default=2, help="threads")
    args = ap.parse_args(argv)
    if args.depth < 1 or args.n < 1 or args.r < 1 or args.t < 1:
        ap.error(f"--depth, -n, -r and -t must be >= 1, got {args.depth}, {args.n}, {args.r}, "
                 f"{args.t}")
    args.paths = [args.workdir / f"{m}-{args.quant}.gguf" for m in args.models.split(",") if m]
    if missing := [str(p) for p in args.paths if not p.exists()]:
        ap.error(f"no such files: {missing} (bench/shapes_vs_llamabench.py hybrids "
                 f"--build-only makes them)")
    return args


def median_split(splits: list[LayerSplit]) -> LayerSplit:
    """Each figure's median over the rounds."""
    med = statistics.median
    return LayerSplit(splits[0].test, splits[0].depth, sum(s.steps for s in splits),
                      med([s.step_ms for s in splits]),
                      {k: med([s.ms[k] for s in splits]) for k in KINDS})


class NotInC(Exception):
    """A model whose decode steps do not run in the one C call (the path the profile times)."""


def in_c(engine: Engine, split: LayerSplit | None) -> LayerSplit:
    if split is None:
        raise NotInC(f"{engine.model_name}: no decode step ran in the one C call, which is "
                     "the path the profile times")
    return split


def rate_ratio(shallow_ms: float, deep_ms: float) -> float:
    """A share's tok/s at depth over at depth 0: its time per token at 0 over at depth."""
    return shallow_ms / deep_ms if shallow_ms > 0 and deep_ms > 0 else float("nan")


def depth_zero(engine: Engine, args: argparse.Namespace) -> tuple[float, float, LayerSplit]:
    """Median tg tok/s with the profile off and on (alternating rounds), and the split."""
    off, on, splits = [], [], []
    for _ in range(args.r):
        off.append(bench_tg(engine, args.n, 1).tok_s_mean)
        result, split = profiled_tg(engine, args.n, 1)
        on.append(result.tok_s_mean)
        splits.append(in_c(engine, split))
    return statistics.median(off), statistics.median(on), median_split(splits)


def report(name: str, off: float, on: float, shallow: LayerSplit, deep: LayerSplit) -> None:
    print(f"profile cost at depth 0: {shallow.test} {off:.2f} t/s off, {on:.2f} t/s on "
          f"(on / off {on / off:.3f})")
    print(f"{'kind':<12}{'ms/tok d0':>11}{f'd{deep.depth}':>11}{'rate d/d0':>11}")
    rows = [(k, shallow.ms[k], deep.ms[k]) for k in KINDS]
    for kind, a, b in rows + [("whole step", shallow.step_ms, deep.step_ms)]:
        print(f"{kind:<12}{a:>11.3f}{b:>11.3f}{rate_ratio(a, b):>11.3f}")
    ratio = rate_ratio(shallow.ms["recurrent"], deep.ms["recurrent"])
    verdict = "met" if ratio >= DEPTH_TARGET else "missed"
    print(f"{name}: recurrent share tg at depth {deep.depth} / depth 0 = {ratio:.3f} "
          f"(target >= {DEPTH_TARGET}: {verdict}); attention share "
          f"{rate_ratio(shallow.ms['attention'], deep.ms['attention']):.3f}; whole step "
          f"{rate_ratio(shallow.step_ms, deep.step_ms):.3f}")


def run_model(path: Path, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    engine = Engine.from_model(str(path), EngineConfig(
        threads=args.t, max_num_seqs=1, enable_prefix_caching=False,
        max_num_batched_tokens=512, max_model_len=max(args.depth + args.n + 2, 2048)))
    try:
        bench_tg(engine, 4, 1)  # pages the weights in, warms the allocator
        off, on, shallow = depth_zero(engine, args)
        deep = in_c(engine, profiled_tg(engine, args.n, args.r, args.depth)[1])
    finally:
        engine.close()
    print(f"\n== {path.stem} ({args.t} threads; tg{args.n}, {args.r} repetitions; "
          f"{time.perf_counter() - start:.0f} s)")
    report(path.stem, off, on, shallow, deep)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for path in args.paths:
        try:
            run_model(path, args)
        except NotInC as e:
            print(f"\n== {path.stem}: skipped: {e}", flush=True)


if __name__ == "__main__":
    main()
