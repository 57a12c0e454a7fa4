"""Greedy outputs alone vs batched: 16 prompts run one at a time, then all together in one
continuous batch; prints how many continuations are identical and, where one differs, the
first differing step and the reference's top-2 margin there (a near-tie flips, a bug does not
stop at near-ties).

    .venv/bin/python bench/batch_invariance.py [-n 32]
"""

from __future__ import annotations

import argparse

from kvlab.engine import Engine, EngineConfig
from kvlab.request import SamplingParams

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
    "The three laws of thermodynamics are", "import numpy as np\n\ndef softmax(x):",
    "A haiku about the sea:", "The quick brown fox", "In 1969, the first humans",
    "Photosynthesis is the process by which", "SELECT name, COUNT(*) FROM users",
    "The best way to learn a new language is", "Water boils at",
    "Dear hiring manager, I am writing to", "The mitochondria is", "fn main() {",
    "Here is a list of prime numbers: 2, 3, 5,",
]


def run(engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    engine = Engine.from_model(None, EngineConfig(threads=args.t, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=args.n, temperature=0, ignore_eos=True, logprobs=2)
    alone = [run(engine, [p], params)[0] for p in PROMPTS]
    batched = run(engine, PROMPTS, params)
    same = sum(a == b for a, b in zip(alone, batched))
    print(f"{same}/{len(PROMPTS)} greedy continuations ({args.n} tokens) identical alone vs "
          f"batched with {len(PROMPTS) - 1} others")
    for prompt, a, b in zip(PROMPTS, alone, batched):
        if a != b:
            step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            margin = _margin(engine, prompt, a[:step])
            print(f"  {prompt[:30]!r}: first differs at step {step}, top-2 margin there "
                  f"{margin:.3f} nats")


def _margin(engine: Engine, prompt: str, prefix: list[int]) -> float:
    ids = engine.tokenizer.encode(prompt)
    lp = engine.teacher_forced_logprobs(ids + prefix, len(ids))[-1]
    top = lp.topk(2).values
    return float(top[0] - top[1])


if __name__ == "__main__":
    main()
