#!/usr/bin/env python3
"""Host time of making a decode step's text, which the server takes off the step loop: batch B
of greedy requests on the default model, each with stop strings that never match (as chat
clients send them), timed around Engine.core_step() and around the output processor's
process() of that step's outputs (detokenizing, stop strings, RequestOutputs).

    .venv/bin/python bench/output_overlap.py [--batches 16,64,256] [--steps 16] [--device cuda]

Prints, per batch, the median ms per decode step of the core step and of the processor, the
processor's µs per token, and its share of the two: what Engine.step() spends in line and
the server's output thread spends while the next step runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.engine import Engine, EngineConfig
from kvlab.request import SamplingParams

PROMPT = "Write a long story about a river that flows through three kingdoms:"
STOPS = ("\n\nUser:", "<|im_end|>", "THE END")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("-n", "--steps", type=int, default=16, help="decode steps timed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=None)
    return ap.parse_args()


def decode_steps(engine: Engine, batch: int, steps: int) -> tuple[list[float], list[float]]:
    """(core step seconds, processor seconds) of `steps` steps once all `batch` decode."""
    params = SamplingParams(max_tokens=4 * steps + 64, temperature=0, ignore_eos=True,
                            stop=STOPS)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, PROMPT, params)
    decoding: set[str] = set()
    while len(decoding) < batch:  # prefill (chunked), until every request has a token
        decoding.update(o.request_id for o in engine.step() if o.new_token_ids)
    core_s, text_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.core_step()
        mid = time.perf_counter()
        _ = engine.outputs.process(outputs).outputs  # built when read, as the server reads
        core_s.append(mid - start)
        text_s.append(time.perf_counter() - mid)
    for rid in ids:
        engine.abort(rid)
    return core_s, text_s


def main() -> None:
    args = parse()
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.from_model(None, EngineConfig(
        device=args.device, threads=args.threads, kv_cache_gib=1.0, max_num_seqs=max(batches),
        max_num_batched_tokens=max(512, max(batches)), enable_prefix_caching=False))
    print(f"{engine.model_name} on {args.device}, {args.steps} decode steps per batch")
    for batch in batches:
        core_s, text_s = decode_steps(engine, batch, args.steps)
        core, text = statistics.median(core_s), statistics.median(text_s)
        print(f"batch {batch:4d}: core step {1e3 * core:8.2f} ms   text {1e3 * text:7.3f} ms "
              f"({1e6 * text / batch:5.1f} µs/token)   text's share of step(): "
              f"{text / (core + text):6.1%}")


if __name__ == "__main__":
    main()
