"""A long prompt arriving while others decode: its TTFT, and what it does to their inter-token
latency, against a running server.

    kvlab serve --port 8000 --max-model-len 17000 &
    .venv/bin/python bench/long_prompt_serving.py --url http://127.0.0.1:8000 \
        [--prompt-tokens 16000] [--streams 4]

`--streams` streaming completions decode (ignore_eos, long max_tokens); once each has
produced some tokens, one completion with a prompt of about `--prompt-tokens` tokens is sent.
It prints that request's TTFT and prompt length (the server's usage), and the decoding
streams' inter-token latency p50 / p99 / max before the long prompt arrived and while it was
prefilled: chunked prefill should keep them moving, one budget-sized chunk per step.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from openai import OpenAI

WORDS = ("paged", "attention", "keeps", "keys", "and", "values", "in", "blocks", "while", "a",
         "scheduler", "batches", "decoding", "sequences", "and", "splits", "long", "prompts",
         "into", "chunks", "under", "a", "token", "budget")


def long_text(words: int) -> str:
    """Varied text (a counter in every sentence) so no tokenizer merges it into few tokens."""
    out = []
    for i in range(words // 12 + 1):
        out.append(f"Note {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(10)) + ".")
    return " ".join(out)


def decode_stream(client: OpenAI, model: str, max_tokens: int, times: list[float],
                  stop: threading.Event) -> None:
    stream = client.completions.create(model=model, prompt="Once upon a time", stream=True,
                                       max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if stop.is_set():
            break
    stream.close()


def itl_ms(times: list[list[float]], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of each stream whose later token arrived in [lo, hi]."""
    return [1e3 * (b - a) for ts in times for a, b in itertools.pairwise(ts) if lo <= b <= hi]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def describe(name: str, xs: list[float]) -> str:
    if not xs:
        return f"{name}: no tokens"
    return (f"{name}: {len(xs)} gaps, p50 {statistics.median(xs):.0f} ms, "
            f"p99 {_pct(xs, 0.99):.0f} ms, max {max(xs):.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--prompt-tokens", type=int, default=16000)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=3000,
                   help="max_tokens of each decoding stream: enough to outlast the prefill")
    p.add_argument("--warm-tokens", type=int, default=16,
                   help="tokens each stream makes before the long prompt is sent")
    args = p.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", timeout=3600)
    model = client.models.list().data[0].id
    text = long_text(int(args.prompt_tokens * 0.66))  # ~1.45 tokens a word for this text
    times: list[list[float]] = [[] for _ in range(args.streams)]
    stop = threading.Event()
    threads = [threading.Thread(target=decode_stream, args=(client, model, args.stream_tokens,
                                                            t, stop), daemon=True) for t in times]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < args.warm_tokens:
        if not all(t.is_alive() for t in threads):
            raise SystemExit("a decoding stream ended before the long prompt was sent")
        time.sleep(0.05)
    sent = time.perf_counter()
    stream = client.completions.create(model=model, prompt=text, max_tokens=4, stream=True,
                                       temperature=0, stream_options={"include_usage": True})
    first, prompt_tokens = None, None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(f"long prompt: {prompt_tokens} tokens, TTFT {first - sent:.2f} s "
          f"({prompt_tokens / (first - sent):.0f} prompt tok/s) with {args.streams} streams "
          "decoding")
    print(describe("  their ITL before it arrived", itl_ms(times, 0, sent)))
    print(describe("  their ITL during its prefill", itl_ms(times, sent, first)))


if __name__ == "__main__":
    main()
