"""Where a decode step's time goes: ms per step, how much of it the one C call that runs all
decode layers takes (products, norms, attention; the default Gemma 3 or any GGUF), the other
matmul kernels (the output head), and the rest (Python, small torch ops, sampling).

    .venv/bin/python bench/decode_step.py [-m FILE] [--batch 1] [--steps 100] [-t 2]
                                          [--no-group-rows]
"""

from __future__ import annotations

import argparse
import time

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import ops
from kvlab.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None, help="a GGUF file (default: the Gemma 3 model)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--no-group-rows", action="store_true",
                    help="keep Q8_0/Q5_0/Q4_0 in GGUF row order (the plain kernels)")
    args = ap.parse_args()
    config = EngineConfig(threads=args.t, enable_prefix_caching=False,
                          group_rows=not args.no_group_rows)
    engine = Engine.from_model(args.model, config)
    params = SamplingParams(max_tokens=args.steps + 20, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [2, *range(1000 + 7 * i, 1020 + 7 * i)], params)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    seconds = {"qmatmul": 0.0, "decode_layers": 0.0}

    def timed(name: str):
        fn = getattr(ops._qk, name)

        def call(*a: object) -> object:
            start = time.perf_counter()
            out = fn(*a)
            seconds[name] += time.perf_counter() - start
            return out
        return call

    for name in seconds:
        setattr(ops._qk, name, timed(name))
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - start) / args.steps
    products, layers = (seconds[k] / args.steps for k in ("qmatmul", "decode_layers"))
    rest = total - products - layers
    print(f"batch {args.batch}: {total * 1e3:.2f} ms/step ({args.batch / total:.1f} tok/s), "
          f"C decode layers {layers * 1e3:.2f} ms, other matmul kernels {products * 1e3:.2f} ms "
          f"(the output head), everything else {rest * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
