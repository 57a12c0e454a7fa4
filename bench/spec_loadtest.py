"""What speculative decoding costs a loaded server: `kvlab loadtest` at one concurrency against
kvlab serve with and without `--speculative ngram` (or a draft model), output tok/s of both
and their ratio (target: with >= 0.95x without).

    .venv/bin/python bench/spec_loadtest.py [-c 8] [-n 32] [--max-tokens 64] [-t 2] [-k 4]
        [-r 2] [-m MODEL.gguf] [--draft-model PATH]

Each round starts kvlab serve (`--max-num-seqs` the concurrency, -t threads) plain and then
speculative, or the other way round on odd rounds, loads it with `kvlab loadtest -c C
--endpoint completions --ignore-eos` (loadtest's built-in prompts: free generation, where
proposals seldom hold, so this measures what speculation costs where it cannot help) and
stops it; one server is up at a time. Prints each run's output tok/s, the medians and the
ratio, and beside each speculative run the server's own counts (/metrics): verify runs,
tokens proposed and accepted, which say what the planner did whatever the timings. Figures
are meaningless while other work shares the cores.
"""

from __future__ import annotations

import argparse
import re
import statistics
import urllib.request

from moe_serving import loadtest  # the sibling scripts' helpers, by path
from server_soak import start_server
from spec_vs_llama_server import free_port

from kvlab.weights.default_model import default_model_path

TARGET = 0.95


COUNTS = {"verify runs": "kvlab:spec_decode_num_drafts_total",
          "proposed": "kvlab:spec_decode_num_draft_tokens_total",
          "accepted": "kvlab:spec_decode_num_accepted_tokens_total"}


def spec_counts(port: int) -> str:
    """The server's speculative counters, as one line."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {}
    for name, metric in COUNTS.items():
        pattern = rf"^{re.escape(metric)}\{{[^}}]*\}} ([0-9.e+]+)$"
        found = re.search(pattern, text, re.MULTILINE)
        got[name] = int(float(found.group(1))) if found else 0
    return ", ".join(f"{v} {k}" for k, v in got.items())


def serve_and_load(flags: list[str], args: argparse.Namespace) -> tuple[float, str]:
    """Output tok/s of one loadtest against a fresh kvlab serve with `flags`, and its
    speculative counts (warm-up requests included)."""
    port = free_port()
    proc = start_server(port, ["--model", args.model, "--threads", str(args.t),
                               "--max-num-seqs", str(args.c), *flags])
    try:
        rate = loadtest(port, argparse.Namespace(sweep=str(args.c), n=args.n,
                                                 max_tokens=args.max_tokens))[args.c]
        return rate, spec_counts(port) if flags else ""
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", type=int, default=8, help="requests in flight")
    ap.add_argument("-n", type=int, default=32, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("-t", type=int, default=2, help="server threads")
    ap.add_argument("-k", type=int, default=4, help="--num-speculative")
    ap.add_argument("-r", type=int, default=2, help="rounds (median)")
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: kvlab's default model)")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="speculate with this draft model instead of prompt lookup")
    args = ap.parse_args()
    args.model = args.model or str(default_model_path())
    method = ["--speculative", "ngram"] if args.draft_model is None else [
        "--speculative", "draft", "--draft-model", args.draft_model]
    runs = {"plain": [], "speculative": []}
    flags = {"plain": [], "speculative": [*method, "--num-speculative", str(args.k)]}
    for r in range(args.r):
        for name in ("plain", "speculative") if r % 2 == 0 else ("speculative", "plain"):
            rate, counts = serve_and_load(flags[name], args)
            runs[name].append(rate)
            print(f"round {r + 1}: {name:<11} {rate:8.1f} output tok/s"
                  + (f"  ({counts})" if counts else ""), flush=True)
    plain, spec = (statistics.median(runs[k]) for k in ("plain", "speculative"))
    ratio = spec / plain
    print(f"\nconcurrency {args.c}, {args.n} requests of {args.max_tokens} tokens, median of "
          f"{args.r}: plain {plain:.1f}, {' '.join(method)} {spec:.1f} output tok/s; "
          f"ratio {ratio:.2f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
