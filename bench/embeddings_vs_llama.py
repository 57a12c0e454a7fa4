"""kvlab's embeddings beside llama.cpp's `llama-embedding` on the same GGUF: how far the
vectors sit apart (max |difference|, lowest cosine), then sequences/s for N inputs of about
128 tokens each at the same thread count.

    .venv/bin/python bench/embeddings_vs_llama.py MODEL.gguf --llama-embedding PATH -n 64 -t 2 -r 3

Without --llama-embedding only kvlab's side is printed (as `kvlab embed --bench` does, with
text instead of random ids). llama-embedding's time is its run on N inputs less its run on
one, so the model load is not counted; kvlab's is the embed calls alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from kvlab.engine import Engine, EngineConfig

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "old", "rivers", "and",
         "young", "painters", "sketch", "distant", "mountains", "at", "dawn"]
CHECK_TEXTS = ["Hello world!", "The quick brown fox jumps over the lazy dog.",
               "Embeddings turn text into vectors.", "this is 🦙.cpp"]


def texts_of(engine: Engine, n: int, tokens: int) -> list[str]:
    """n texts that each encode to about `tokens` tokens (special tokens included)."""
    out = []
    for i in range(n):
        words: list[str] = []
        while len(engine.tokenizer.encode(" ".join(words))) < tokens:
            words.append(WORDS[(i * 7 + len(words) * 3) % len(WORDS)])
        out.append(" ".join(words))
    return out


def llama_vectors(binary: str, model: str, texts: list[str], threads: int
                  ) -> tuple[np.ndarray, float]:
    """(vectors [n, dim], seconds of the whole run) from llama-embedding's JSON output."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(texts))
    start = time.perf_counter()
    out = subprocess.run([binary, "-m", model, "-f", f.name, "-t", str(threads),
                          "--embd-output-format", "json", "--embd-normalize", "2"],
                         capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    Path(f.name).unlink()
    data = json.loads(out.stdout[out.stdout.index("{"):])["data"]
    return np.array([d["embedding"] for d in data], dtype=np.float32), seconds


def kvlab_seconds(engine: Engine, ids: list[list[int]], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(ids), batch):
        engine.embed(ids[i:i + batch])
    return time.perf_counter() - start


def llama_seconds(binary: str, model: str, texts: list[str], threads: int) -> float:
    """llama-embedding on all texts less its run on one (the model load is not counted)."""
    _, one = llama_vectors(binary, model, texts[:1], threads)
    _, all_n = llama_vectors(binary, model, texts, threads)
    return max(all_n - one, 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--llama-embedding", default=None, help="path of llama.cpp's binary")
    p.add_argument("-n", type=int, default=64, help="inputs to time")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="kvlab's inputs per forward")
    p.add_argument("-r", "--rounds", type=int, default=3,
                   help="rounds, kvlab and llama.cpp alternating within each")
    args = p.parse_args()
    engine = Engine.from_model(args.model, EngineConfig(threads=args.threads))
    texts = texts_of(engine, args.n, args.tokens)
    ids = [engine.tokenizer.encode(t) for t in texts]
    engine.embed(ids[:args.batch])  # warm-up
    tokens = sum(map(len, ids))
    if args.llama_embedding is not None:
        ours = engine.embed([engine.tokenizer.encode(t) for t in CHECK_TEXTS]).numpy()
        theirs, _ = llama_vectors(args.llama_embedding, args.model, CHECK_TEXTS, args.threads)
        cosine = ((ours * theirs).sum(1) / np.linalg.norm(ours, axis=1)
                  / np.linalg.norm(theirs, axis=1))
        print(f"vectors vs llama.cpp: max |diff| {np.abs(ours - theirs).max():.2e}, "
              f"lowest cosine {cosine.min():.6f} ({len(CHECK_TEXTS)} texts)")
    ratios = []
    for r in range(args.rounds):
        kv_s = kvlab_seconds(engine, ids, args.batch)
        line = (f"round {r + 1}: kvlab {args.n} inputs, {tokens} tokens, {args.threads} "
                f"threads: {args.n / kv_s:.1f} sequences/s ({tokens / kv_s:.0f} tokens/s)")
        if args.llama_embedding is not None:
            ll_s = llama_seconds(args.llama_embedding, args.model, texts, args.threads)
            ll_rate = (args.n - 1) / ll_s
            ratios.append((args.n / kv_s) / ll_rate)
            line += f"; llama.cpp {ll_rate:.1f} sequences/s; kvlab / llama.cpp {ratios[-1]:.2f}x"
        print(line, flush=True)
    if ratios:
        print(f"median kvlab / llama.cpp: {float(np.median(ratios)):.2f}x over {len(ratios)} "
              "alternating rounds")


if __name__ == "__main__":
    main()
