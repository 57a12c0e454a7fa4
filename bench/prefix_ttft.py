"""Prefix caching seen from a client: the same ~1,000-token prompt twice against a running
server, TTFT of each (streaming) and the cached_tokens the second reports.

    .venv/bin/python bench/prefix_ttft.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI

PARAGRAPH = ("Paged attention stores the keys and values of every token in fixed-size blocks, "
             "and a block table maps each sequence's positions to physical blocks. ")


def ttft(client: OpenAI, model: str, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    first, cached = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=True,
                                       temperature=0, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return first or float("nan"), cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--repeats", type=int, default=36, help="paragraphs (~28 tokens each)")
    args = ap.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none")
    model = client.models.list().data[0].id
    prompt = f"[{time.time()}] " + PARAGRAPH * args.repeats  # fresh: never cached before
    first, _ = ttft(client, model, prompt)
    second, cached = ttft(client, model, prompt)
    print(f"first  TTFT {first * 1e3:8.1f} ms")
    print(f"second TTFT {second * 1e3:8.1f} ms  ({100 * second / first:.0f} % of the first), "
          f"cached_tokens {cached}")


if __name__ == "__main__":
    main()
