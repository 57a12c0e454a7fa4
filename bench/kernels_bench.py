"""Kernel figures on the default model, read against this machine's ceilings.

    python bench/kernels_bench.py [--model FILE.gguf] [--threads 1,2] [--quick] [--types-only]
                                  [--prefill-types] [--rounds N]

Prints, in one run:
  * memory read bandwidth (torch sum over a 1 GiB fp32 tensor), per thread count;
  * decode: qmatmul with n=1 on token_embd (Q8_0, 178 MB) and on every Q4_K, Q6_K and Q5_0
    matrix of the model, cycled through copies larger than the L3 cache so the weights come
    from DRAM as they do in a real decode step; GB/s = weight bytes read / time;
  * one decode step's products (all layers + the tied output head) -> the tok/s ceiling;
  * batched decode n=4,16 on token_embd (the weights are read once per step);
  * prefill: qmatmul (integer kernels) and dense_matmul (fp32 tiles + torch.mm) with n=512
    against torch fp32 matmul, GFLOP/s;
  * per weight type (Q4_K, IQ4_NL, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) on one
    4096x4096 shape, as stored and in 8-row groups where the loader groups it: decode n=1
    and n=8 GB/s and weights/s, each next to Q4_K's in the same layout (random blocks: a
    product's speed does not depend on the values); then with --types-only each type's
    decode (n=1, ns per row) and prefill (n=64) time against Q4_K's, one thread, the types
    taking turns for --rounds calls, median and fastest call of each, so a machine shared
    with other work still gives fair ratios. --types-only prints just these.
  * --prefill-types prints only each IQ type's prefill (n=512) at a Llama 3.2 1B MLP's two
    shapes, 8192x2048 (gate, up) and 2048x8192 (down), next to Q4_K in 8-row groups (what a
    Q4_K_M file's prefill runs), the types taking turns for --rounds calls at each of
    --threads' counts: GFLOP/s of the median call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.kernels import (
    QuantizedWeight,
    can_group,
    dequantize,
    group_rows,
    kernel_backend_detail,
    qmatmul,
    set_num_threads,
)
from kvlab.kernels.ops import dense_matmul
from kvlab.weights.gguf_file import GGUFFile

T = GGMLQuantizationType
DRAM_SET_BYTES = 128 << 20  # > 4x the 32 MiB L3 here: cycled matrices miss the cache
TYPES = (T.Q4_K, T.IQ4_NL, T.MXFP4, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)
TYPE_SHAPE = (4096, 4096)
LATTICE_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)  # grid-decoded IQ types


def pass_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of `reps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call, after one warm-up call."""
    return statistics.median(pass_times(fn, reps))


def memory_bandwidth(reps: int) -> float:
    big = torch.ones(1 << 28)  # 1 GiB of fp32
    return big.nbytes / timed(lambda: big.sum(), reps) / 1e9


def dram_copies(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Distinct copies of `weights` totalling at least DRAM_SET_BYTES."""
    out, total = [], 0
    while total < DRAM_SET_BYTES:
        for w in weights:
            out.append(QuantizedWeight(w.qtype, w.shape, w.data.clone(), grouped=w.grouped))
            total += w.nbytes
    return out


def cycle_gbps(weights: list[QuantizedWeight], n: int, reps: int) -> float:
    xs = {w.in_features: torch.randn(n, w.in_features) for w in weights}

    def run() -> None:
        for w in weights:
            qmatmul(xs[w.in_features], w)

    return sum(w.nbytes for w in weights) / timed(run, reps) / 1e9


def decode_step_products(file: GGUFFile) -> list[QuantizedWeight]:
    """Every matrix one decode token multiplies by, in model order, the output head last."""
    names = [n for n, t in file.tensors.items() if len(t.shape) == 2 and n != "token_embd.weight"]
    names.sort(key=lambda n: int(n.split(".")[1]) if n.startswith("blk.") else 1 << 30)
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    return [QuantizedWeight.from_gguf(file, n) for n in names + [head]]


def prefill_gflops(w: QuantizedWeight, n: int, reps: int) -> tuple[float, float, float]:
    x = torch.randn(n, w.in_features)
    dense = dequantize(w)
    flops = 2.0 * n * w.in_features * w.out_features
    ours = flops / timed(lambda: qmatmul(x, w), reps) / 1e9
    tiles = flops / timed(lambda: dense_matmul(x, w), reps) / 1e9
    ref = flops / timed(lambda: x @ dense.T, reps) / 1e9
    return ours, tiles, ref


def random_weight(qtype: GGMLQuantizationType, rows: int, cols: int) -> QuantizedWeight:
    """Random bytes under small scales (fp16 d, Q4_K's d and dmin, MXFP4's exponent 2^-1):
    valid blocks of every type in TYPES."""
    g = np.random.default_rng(0)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = g.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == T.MXFP4:
        blocks[:, 0] = 127
    else:
        scales = g.uniform(0.001, 0.02, (len(blocks), 2)).astype(np.float16).view(np.uint8)
        lead = 4 if qtype == T.Q4_K else 2
        blocks[:, :lead] = scales[:, :lead]
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(blocks.reshape(rows, -1)))


def type_rows(reps: int, bw: float) -> None:
    """Decode GB/s of each weight type on one shape, cycled from DRAM, next to Q4_K's."""
    rows, cols = TYPE_SHAPE
    base: dict[tuple[bool, int], tuple[float, float]] = {}
    print(f"per type, {rows}x{cols} random blocks cycled from DRAM (weights/s: the same "
          "shape's rows per second, bytes aside)")
    for qtype in TYPES:
        w = random_weight(qtype, rows, cols)
        bits = 8 * w.nbytes / (rows * cols)
        for layout in [w, group_rows(w)] if can_group(w) else [w]:
            ws = dram_copies([layout])
            for n in (1, 8):
                g = cycle_gbps(ws, n, reps)
                gw = g / bits * 8  # Gweights/s
                ref = base.setdefault((layout.grouped, n), (g, gw))
                print(f"  {layout.type_name:9s} {bits:4.2f} bpw  n={n}: {g:6.1f} GB/s "
                      f"({g / bw:4.0%} of memory bandwidth, {g / ref[0]:5.2f}x Q4_K), "
                      f"{gw:6.1f} Gweights/s ({gw / ref[1]:5.2f}x Q4_K)")


def interleaved_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `rounds` calls of each function, the functions taking turns: on a
    shared machine the load then falls on each alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def type_speeds(rounds: int) -> None:
    """Each type's product against Q4_K's on the same shape, one thread, weights in cache,
    interleaved: decode n=1 (time per row of equal width; Q4_K also in the 8-row groups the
    loader makes of it) and prefill n=64 (GFLOP/s). Median and fastest call of each: the
    fastest is the least disturbed on a shared machine."""
    rows, cols = TYPE_SHAPE
    set_num_threads(1)
    ws = {q.name: random_weight(q, rows, cols) for q in TYPES}
    ws = {T.Q4_K.name: ws[T.Q4_K.name], "Q4_Kx8": group_rows(ws[T.Q4_K.name])} | ws
    print(f"\nper type against Q4_K, {rows}x{cols} in cache, 1 thread, interleaved calls: median "
          "(fastest) (>1: faster than Q4_K)")
    for n, turns in ((1, rounds), (64, max(3, rounds // 8))):
        x = torch.randn(n, cols)
        times = interleaved_times({name: partial(qmatmul, x, w) for name, w in ws.items()
                                   if n == 1 or not w.grouped}, turns)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            t, best = med[name], min(ts)
            print(f"  {name:9s} n={n:<3d} {t * 1e9 / rows:7.1f} ns/row ({best * 1e9 / rows:7.1f})  "
                  f"{2.0 * n * rows * cols / t / 1e9:6.1f} GFLOP/s  "
                  f"{med[T.Q4_K.name] / t:5.2f}x Q4_K")


def prefill_type_speeds(rounds: int) -> None:
    """n=512 GFLOP/s of the IQ types and grouped Q4_K at an MLP's two shapes, interleaved."""
    n = 512
    for rows, cols in ((8192, 2048), (2048, 8192)):
        ws = {q.name: random_weight(q, rows, cols) for q in LATTICE_TYPES}
        ws["Q4_Kx8"] = group_rows(random_weight(T.Q4_K, rows, cols))
        x = torch.randn(n, cols)
        times = interleaved_times({name: partial(qmatmul, x, w) for name, w in ws.items()},
                                  max(3, rounds))
        cells = [f"{name} {2.0 * n * rows * cols / statistics.median(ts) / 1e9:6.1f}"
                 for name, ts in times.items()]
        print(f"  prefill n={n} {rows}x{cols} GFLOP/s: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--types-only", action="store_true",
                    help="only the per-type decode figures (Q4_K, MXFP4, the IQ types)")
    ap.add_argument("--prefill-types", action="store_true",
                    help="only the IQ types' prefill at an MLP's shapes, next to Q4_K's")
    ap.add_argument("--rounds", type=int, default=48,
                    help="turns of the interleaved per-type comparison (--types-only)")
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    if args.prefill_types:
        print(f"kernels: {kernel_backend_detail()}")
        for nt in [int(v) for v in args.threads.split(",")]:
            set_num_threads(nt)
            print(f"\n== {nt} thread(s)")
            prefill_type_speeds(args.rounds)
        return
    if args.types_only:
        print(f"kernels: {kernel_backend_detail()}")
        for nt in [int(v) for v in args.threads.split(",")]:
            set_num_threads(nt)
            bw = memory_bandwidth(reps)
            print(f"\n== {nt} thread(s): memory read bandwidth {bw:.1f} GB/s (torch sum, 1 GiB)")
            type_rows(reps, bw)
        type_speeds(args.rounds)
        return
    if args.model is None:
        from kvlab.weights.default_model import default_model_path

        args.model = str(default_model_path())
    file = GGUFFile(args.model)
    embd = QuantizedWeight.from_gguf(file, "token_embd.weight")
    by_type = {q: [QuantizedWeight.from_gguf(file, n) for n, t in file.tensors.items()
                   if t.qtype == q and len(t.shape) == 2] for q in (T.Q4_K, T.Q6_K, T.Q5_0)}
    sets = {q.name: dram_copies(ws) for q, ws in by_type.items()}
    step = decode_step_products(file)
    step_bytes = sum(w.nbytes for w in step)
    print(f"kernels: {kernel_backend_detail()}   model: {args.model}")
    for nt in [int(v) for v in args.threads.split(",")]:
        set_num_threads(nt)
        bw = memory_bandwidth(reps)
        print(f"\n== {nt} thread(s): memory read bandwidth {bw:.1f} GB/s (torch sum, 1 GiB)")
        g = embd.nbytes / timed(partial(qmatmul, torch.randn(1, 640), embd), reps) / 1e9
        print(f"decode n=1  token_embd Q8_0 262144x640 {embd.nbytes / 1e6:.0f} MB: "
              f"{g:5.1f} GB/s = {g / bw:4.0%} of memory bandwidth")
        for name, ws in sets.items():
            g = cycle_gbps(ws, 1, reps)
            shapes = sorted({f"{w.shape[0]}x{w.shape[1]}" for w in by_type[T[name]]})
            print(f"decode n=1  {name:4s} model matrices ({', '.join(shapes)}), "
                  f"{len(ws)} copies: {g:5.1f} GB/s = {g / bw:4.0%}")
        dt = step_bytes / cycle_gbps(step, 1, reps) / 1e9
        print(f"decode step: {len(step)} products, {step_bytes / 1e6:.0f} MB in {dt * 1e3:.2f} ms"
              f" = {step_bytes / dt / 1e9:.1f} GB/s -> at most {1 / dt:.0f} tok/s")
        for n in (4, 16):
            dt = timed(partial(qmatmul, torch.randn(n, 640), embd), reps)
            print(f"decode n={n:<2d} token_embd: {dt * 1e3:6.1f} ms, weights {embd.nbytes / dt / 1e9:.1f}"
                  f" GB/s, {2 * n * embd.nbytes / 1.0625 / dt / 1e9:.0f} GOP/s")
        for name in ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.attn_output.weight"):
            w = QuantizedWeight.from_gguf(file, name)
            ours, tiles, ref = prefill_gflops(w, 512, reps)
            print(f"prefill n=512 {name} {w.qtype.name} {w.shape[0]}x{w.shape[1]}: integer "
                  f"{ours:5.1f}, fp32 tiles {tiles:5.1f} GFLOP/s vs torch fp32 matmul "
                  f"{ref:5.1f} ({ours / ref:4.0%}, {tiles / ref:4.0%})")
        type_rows(reps, bw)


if __name__ == "__main__":
    main()
