"""`kvlab serve` against llama.cpp's llama-server on a mixture-of-experts GGUF, both under
`kvlab loadtest`, and the peak RSS of `kvlab run` on the file against its tensor bytes.

    .venv/bin/python bench/moe_serving.py [--model FILE.gguf] [--sweep 1,4,8] [-n 16]
        [--max-tokens 64] [-t 2] [--llama-bin DIR] [--skip-rss]

One server at a time has the machine: llama-server (`--parallel` the largest level, a context
of 1024 tokens a slot), then kvlab serve (`--max-num-seqs` the same), on the same threads.
Each is loaded by `kvlab loadtest --sweep ... --endpoint completions --ignore-eos` (every
request yields exactly --max-tokens, no chat template on either side), and the script prints
each level's output tok/s, kvlab / llama-server, and the target at the largest level (1.5x).
Then `/usr/bin/time -v kvlab run` on the file: its peak RSS against the file's tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from greedy_vs_llama_server import start_llama_server  # the sibling scripts' helpers, by path
from quant_peers import KVLAB_CLI, LLAMA_BIN, cpu_kind, decode_bytes_as_stored
from server_soak import start_server

MOE_FILE = Path("/tmp/kvlab-moe-peers/olmoe-1b-7b-shape-16L-Q4_K_M.gguf")
TARGET_AT_LARGEST = 1.5
LLAMA_PORT, KVLAB_PORT = 8093, 8094


def loadtest(port: int, args: argparse.Namespace) -> dict[int, float]:
    """{concurrency: output tok/s} of one sweep against the server on `port`."""
    cmd = KVLAB_CLI + ["loadtest", "--url", f"http://127.0.0.1:{port}", "--sweep", args.sweep,
                       "-n", str(args.n), "--max-tokens", str(args.max_tokens), "--ignore-eos",
                       "--endpoint", "completions", "--warmup", "2", "--json"]
    print("#", " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"kvlab loadtest exited with status {proc.returncode}: {proc.stderr[-2000:]}")
    runs = json.loads(proc.stdout[proc.stdout.index("{"):])["sweep"]
    for r in runs:
        if r["failed"]:
            sys.exit(f"{r['failed']} requests failed at concurrency {r['concurrency']}: "
                     f"{r['errors'][:1]}")
    return {r["concurrency"]: r["output_throughput"] for r in runs}


def serve_and_load(name: str, args: argparse.Namespace) -> dict[int, float]:
    largest = max(int(c) for c in args.sweep.split(","))
    if name == "llama-server":
        flags = ("--parallel", str(largest), "-c", str(1024 * largest))
        proc = start_llama_server(args.llama_bin / "llama-server", args.model, args.t,
                                  LLAMA_PORT, flags)
        port = LLAMA_PORT
    else:
        proc = start_server(KVLAB_PORT, ["--model", str(args.model), "--threads", str(args.t),
                                         "--max-num-seqs", str(largest)])
        port = KVLAB_PORT
    try:
        return loadtest(port, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def peak_rss(args: argparse.Namespace) -> tuple[float, float]:
    """(peak RSS of `kvlab run` generating 16 tokens, the file's tensor bytes), in bytes."""
    cmd = ["/usr/bin/time", "-v"] + KVLAB_CLI + ["run", "-m", str(args.model), "--threads",
                                                 str(args.t), "--max-tokens", "16",
                                                 "--ignore-eos", "The experts"]
    print("#", " ".join(["/usr/bin/time", "-v", "kvlab", *cmd[5:]]), flush=True)
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
    return kib * 1024.0, decode_bytes_as_stored(args.model, 1)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MOE_FILE)
    p.add_argument("--sweep", default="1,4,8")
    p.add_argument("-n", type=int, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-t", type=int, default=2, help="threads of both servers")
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    p.add_argument("--skip-rss", action="store_true")
    args = p.parse_args()
    print(f"# CPU: {cpu_kind()}; {args.model.name}; {args.t} threads", flush=True)
    tok_s = {name: serve_and_load(name, args) for name in ("llama-server", "kvlab")}
    print(f"\n{'concurrency':>11} {'kvlab tok/s':>12} {'llama-server':>13} {'kvlab/llama':>12}")
    for level, ours in tok_s["kvlab"].items():
        theirs = tok_s["llama-server"][level]
        print(f"{level:>11} {ours:>12.2f} {theirs:>13.2f} {ours / theirs:>11.2f}x")
    largest = max(tok_s["kvlab"])
    ratio = tok_s["kvlab"][largest] / tok_s["llama-server"][largest]
    print(f"at {largest}: {ratio:.2f}x (target {TARGET_AT_LARGEST}x: "
          f"{'met' if ratio >= TARGET_AT_LARGEST else 'not met'})")
    if not args.skip_rss:
        rss, tensors = peak_rss(args)
        print(f"kvlab run peak RSS {rss / 1e6:.0f} MB, the file's tensors {tensors / 1e6:.0f} MB "
              f"({rss / tensors:.2f}x)")


if __name__ == "__main__":
    main()
