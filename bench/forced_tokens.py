"""Forced tokens in one constrained request, in process: how many output tokens the JSON
schema fixed (appended without sampling), how many engine steps the request took for its
output tokens, and its wall time; then the same prompt unconstrained for the same number of
tokens (every one sampled, one a step) as the baseline.

    .venv/bin/python bench/forced_tokens.py [--schema bench/schemas/order.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from kvlab.engine import Engine, EngineConfig
from kvlab.harness.loadtest import is_valid_json, schema_validator
from kvlab.request import RequestOutput, SamplingParams, Structure

PROMPT = ("Write the order record as JSON: Maria Lopez, account 482913, ships to 12 Harbour "
          "Street, express delivery, two boxes of green tea and one teapot.")


@dataclass
class Run:
    last: RequestOutput
    steps: int  # engine steps that appended output tokens to this request
    seconds: float
    text: str


def run_one(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> Run:
    engine.add_request(request_id, prompt, params)
    steps, parts, last = 0, [], None
    start = time.perf_counter()
    while last is None or not last.finished:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            steps += bool(out.new_token_ids)
            parts.append(out.text_delta)
            last = out
    return Run(last, steps, time.perf_counter() - start, "".join(parts))


def report(label: str, run: Run) -> None:
    out = run.last
    share = out.forced_tokens / out.output_tokens if out.output_tokens else 0.0
    reason = out.finish_reason.value if out.finish_reason else "-"
    print(label)
    print(f"  output tokens  {out.output_tokens} (finish: {reason})")
    print(f"  forced tokens  {out.forced_tokens} ({100 * share:.1f}% of output)")
    print(f"  engine steps   {run.steps} for {out.output_tokens} output tokens "
          f"({out.output_tokens - run.steps} steps saved)")
    print(f"  wall time      {run.seconds:.2f} s  ({out.output_tokens / run.seconds:.1f} tok/s, "
          f"{1e3 * run.seconds / max(run.steps, 1):.1f} ms a step)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schema", default=str(Path(__file__).parent / "schemas" / "order.json"))
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engine = Engine.from_model(None, EngineConfig(threads=args.threads))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    schema = Path(args.schema).read_text(encoding="utf-8")
    structure = Structure("json_schema", schema)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                 structured=structure)
    run_one(engine, "warmup", prompt, constrained)  # compiles the schema, warms the kernels
    run = run_one(engine, "constrained", prompt, constrained)
    print(f"prompt {len(prompt)} tokens, schema {args.schema}, greedy, "
          f"max_tokens {args.max_tokens}")
    report("constrained (JSON schema)", run)
    print(f"  reply          {run.text}")
    follows = schema_validator(json.loads(schema))
    check = "parses as JSON" if follows is None else "follows schema"
    print(f"  {check} {is_valid_json(run.text, follows)}")
    same_length = SamplingParams(max_tokens=run.last.output_tokens, temperature=0,
                                 ignore_eos=True)
    report("unconstrained, same number of tokens", run_one(engine, "free", prompt, same_length))


if __name__ == "__main__":
    main()
