"""Kernel figures on the default model, read against this machine's ceilings.

    python bench/kernels_bench.py [--model FILE.gguf] [--threads 1,2] [--quick]

Prints, in one run:
  * memory read bandwidth (torch sum over a 1 GiB fp32 tensor), per thread count;
  * decode: qmatmul with n=1 on token_embd (Q8_0, 178 MB) and on every Q4_K, Q6_K and Q5_0
    matrix of the model, cycled through copies larger than the L3 cache so the weights come
    from DRAM as they do in a real decode step; GB/s = weight bytes read / time;
  * one decode step's products (all layers + the tied output head) -> the tok/s ceiling;
  * batched decode n=4,16 on token_embd (the weights are read once per step);
  * prefill: qmatmul (integer kernels) and dense_matmul (fp32 tiles + torch.mm) with n=512
    against torch fp32 matmul, GFLOP/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from gguf import GGMLQuantizationType

from kvlab.kernels import QuantizedWeight, dequantize, kernel_backend, qmatmul, set_num_threads
from kvlab.kernels.ops import dense_matmul
from kvlab.weights.gguf_file import GGUFFile

T = GGMLQuantizationType
DRAM_SET_BYTES = 128 << 20  # > 4x the 32 MiB L3 here: cycled matrices miss the cache


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
            out.append(QuantizedWeight(w.qtype, w.shape, w.data.clone()))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    if args.model is None:
        from kvlab.weights.default_model import default_model_path

        args.model = str(default_model_path())
    reps = 3 if args.quick else 7
    file = GGUFFile(args.model)
    embd = QuantizedWeight.from_gguf(file, "token_embd.weight")
    by_type = {q: [QuantizedWeight.from_gguf(file, n) for n, t in file.tensors.items()
                   if t.qtype == q and len(t.shape) == 2] for q in (T.Q4_K, T.Q6_K, T.Q5_0)}
    sets = {q.name: dram_copies(ws) for q, ws in by_type.items()}
    step = decode_step_products(file)
    step_bytes = sum(w.nbytes for w in step)
    print(f"kernels: {kernel_backend()}   model: {args.model}")
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


if __name__ == "__main__":
    main()
