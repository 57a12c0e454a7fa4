"""Where a decode step's time goes: ms per step, and how much of it the quantized matmul
kernels take (the rest is Python, small torch ops, attention and sampling).

    .venv/bin/python bench/decode_step.py [--batch 1] [--steps 100] [-t 2]
"""

from __future__ import annotations

import argparse
import time

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import ops
from kvlab.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    engine = Engine.from_model(None, EngineConfig(threads=args.t, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=args.steps + 20, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [2, *range(1000 + 7 * i, 1020 + 7 * i)], params)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    kernel_seconds = [0.0]
    qmatmul = ops._qk.qmatmul

    def timed(*a: object) -> object:
        start = time.perf_counter()
        out = qmatmul(*a)
        kernel_seconds[0] += time.perf_counter() - start
        return out

    ops._qk.qmatmul = timed
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - start) / args.steps
    kernels = kernel_seconds[0] / args.steps
    print(f"batch {args.batch}: {total * 1e3:.2f} ms/step ({args.batch / total:.1f} tok/s), "
          f"matmul kernels {kernels * 1e3:.2f} ms, everything else {(total - kernels) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
