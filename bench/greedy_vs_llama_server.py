"""Greedy continuations from kvlab and llama.cpp (llama-server) on the same GGUF and prompts.

    .venv/bin/python bench/greedy_vs_llama_server.py --llama-bin DIR [-m MODEL.gguf] [-n 32]

Both engines get the same prompt token ids (kvlab's tokenizer, BOS included) and decode
greedily. Quantized kernels on both sides round activations differently, so the texts may
part where the top two candidates are nearly tied: kvlab's teacher-forced log-probabilities
along its own continuation give the margin at every position, and the verdict is whether
the two continuations agree up to the first position whose margin is below --tie nats.
Where they part, the same weights dequantized to fp32 (kvlab's reference path, equal to
transformers to 2e-3 in log-prob) say how far apart the two engines' tokens are there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from kvlab.engine import EngineConfig
from kvlab.llm import LLM
from kvlab.request import SamplingParams
from kvlab.weights.default_model import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village"]
DEFAULT_BIN = "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def start_llama_server(binary: Path, model: Path, threads: int, port: int,
                       extra: tuple[str, ...] = ("-c", "2048")) -> subprocess.Popen:
    """llama-server on 127.0.0.1:port, once /health answers; `extra`: more flags."""
    proc = subprocess.Popen([str(binary), "-m", str(model), "-t", str(threads), *extra,
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 120 s")


def llama_greedy(port: int, ids: list[int], n: int) -> list[int]:
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
            "return_tokens": True, "cache_prompt": False, "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["tokens"]


def kvlab_greedy(llm: LLM, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """kvlab's greedy tokens and, at each of them, the top-2 log-prob margin."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = llm.generate(ids, params)[0].token_ids
    logprobs = llm.engine.teacher_forced_logprobs(ids + out[:-1], len(ids))
    top2 = logprobs.topk(2, dim=-1).values
    return out, (top2[:, 0] - top2[:, 1]).tolist()


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def reference_gap(ref: LLM, ids: list[int], ours: list[int], theirs: list[int]) -> str:
    """At the first difference: fp32 log-prob of kvlab's token minus llama.cpp's."""
    at = first_difference(ours, theirs)
    if at is None:
        return ""
    lp = ref.engine.teacher_forced_logprobs(ids + ours[:at], len(ids) + at)[0]
    return f"; fp32 reference there: kvlab's token {float(lp[ours[at]] - lp[theirs[at]]):+.3f} " \
           "nats against llama.cpp's"


def compare(name: str, ours: list[int], theirs: list[int], margins: list[float],
            tie: float, context: str = "") -> bool:
    first_diff = first_difference(ours, theirs)
    first_tie = next((i for i, m in enumerate(margins) if m < tie), len(margins))
    ok = first_diff is None or first_diff >= first_tie
    where = "none" if first_diff is None else (
        f"token {first_diff} (kvlab's margin there {margins[first_diff]:.3f} nats{context})")
    print(f"{name!r}: equal for {first_diff if first_diff is not None else len(ours)} of "
          f"{len(ours)} tokens; first difference: {where}; first near-tie (< {tie}): "
          f"token {first_tie} -> {'agree up to the first near-tie' if ok else 'DIFFER'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=32, help="tokens to decode per prompt")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default=DEFAULT_BIN, help="llama.cpp's build/bin folder")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--tie", type=float, default=0.1, help="near-tie margin in nats")
    args = ap.parse_args()
    model = Path(args.model or default_model_path())
    llm = LLM(str(model), EngineConfig(threads=args.threads))
    ref = LLM(str(model), EngineConfig(threads=args.threads, keep_quantized=False))
    server = start_llama_server(Path(args.llama_bin) / "llama-server", model, args.threads,
                                args.port)
    try:
        results = []
        for prompt in PROMPTS:
            ids = llm.tokenizer.encode(prompt)
            ours, margins = kvlab_greedy(llm, ids, args.n)
            theirs = llama_greedy(args.port, ids, args.n)
            results.append(compare(prompt, ours, theirs, margins, args.tie,
                                   reference_gap(ref, ids, ours, theirs)))
    finally:
        server.kill()
    print(f"{sum(results)}/{len(results)} prompts agree up to the first near-tie")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
