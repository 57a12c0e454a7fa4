#!/usr/bin/env python3
"""What enforcing a structure costs a decode step, with nothing forced: batch B of greedy
requests, each unconstrained or under a regex that allows most text (`[a-z ,.]*`, a mask
to fill and apply every step, no forced tokens), same prompt and tokens per request.

    .venv/bin/python bench/structured_overhead.py [--batch 1,8] [--tokens 64] [--threads 2]

Prints ms per decode step and tok/s for both, and their ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.engine import Engine, EngineConfig
from kvlab.request import SamplingParams, Structure

PROMPT = "Write a long sentence about rivers and mountains:"


def run(engine: Engine, batch: int, tokens: int, structure: Structure | None) -> list[float]:
    """Seconds of each step once every request is decoding."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                            structured=structure)
    if structure is not None:
        engine.prepare_structure(structure)
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPT, params)
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        if len(outs) == batch and all(o.output_tokens > 1 for o in outs):
            steps.append(time.perf_counter() - t0)
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engine = Engine.from_model(None, EngineConfig(threads=args.threads))
    regex = Structure("regex", "[a-z ,.]*")
    print("batch  unconstrained ms/step (tok/s)  constrained ms/step (tok/s)  ratio")
    for batch in (int(b) for b in args.batch.split(",")):
        run(engine, batch, 8, None)  # warm-up
        medians = {}
        for name, structure in (("plain", None), ("regex", regex)) * args.repeats:
            medians.setdefault(name, []).append(
                statistics.median(run(engine, batch, args.tokens, structure)))
        plain, constrained = min(medians["plain"]), min(medians["regex"])
        print(f"{batch:5d}  {plain * 1e3:10.2f} ({batch / plain:7.1f})          "
              f"{constrained * 1e3:10.2f} ({batch / constrained:7.1f})        "
              f"{plain / constrained:.3f}")


if __name__ == "__main__":
    main()
