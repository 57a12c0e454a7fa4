"""`kvlab embed "text" ...`: embed texts (or stdin's lines) with the engine and print the
vectors as JSON; `--bench N` times N inputs of `--bench-tokens` tokens instead and prints
sequences/s, tokens/s and the FLOP/s the weight products reached."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvlab.cli.common import add_model_flags, engine_config
from kvlab.engine import Engine
from kvlab.errors import KvlabError


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("embed", help="print embeddings of texts (or stdin's lines) as JSON")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    p.add_argument("--dimensions", type=int, default=None,
                   help="keep the first N dimensions (Matryoshka), then normalize")
    p.add_argument("--no-normalize", action="store_true", help="print vectors as pooled")
    p.add_argument("--truncate", action="store_true",
                   help="cut inputs longer than the context (default: refuse them)")
    p.add_argument("--format", choices=("json", "jsonl"), default="json",
                   help="json: one object with every vector; jsonl: one line per input")
    p.add_argument("--bench", type=int, default=None, metavar="N",
                   help="time N inputs of --bench-tokens random tokens instead")
    p.add_argument("--bench-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="inputs per forward pass")
    add_model_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    engine = Engine.from_model(args.model, engine_config(args))
    if args.bench is not None:
        return bench(engine, args)
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise KvlabError("nothing to embed: give texts as arguments or lines on stdin")
    prompts = [_fit(engine, engine.tokenizer.encode(t), args.truncate, i)
               for i, t in enumerate(texts)]
    vectors = torch.cat([engine.embed(prompts[i:i + args.batch], not args.no_normalize,
                                      args.dimensions)
                         for i in range(0, len(prompts), args.batch)]).tolist()
    if args.format == "jsonl":
        for i, v in enumerate(vectors):
            print(json.dumps({"index": i, "embedding": v}))
        return 0
    print(json.dumps({"model": engine.model_name, "pooling": engine.snapshot().pooling,
                      "prompt_tokens": sum(map(len, prompts)),
                      "data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}))
    return 0


def _fit(engine: Engine, ids: list[int], truncate: bool, index: int) -> list[int]:
    limit = engine.max_model_len
    if len(ids) > limit and not truncate:
        raise KvlabError(f"input {index} has {len(ids)} tokens; the context holds {limit} "
                         "(--truncate cuts it)")
    return ids[:limit]


def bench(engine: Engine, args: argparse.Namespace) -> int:
    """N random-token inputs in batches of --batch; one warm-up batch first."""
    n, tokens = args.bench, args.bench_tokens
    if n < 1 or not 1 <= tokens <= engine.max_model_len:
        raise KvlabError(f"--bench needs N >= 1 and --bench-tokens in [1, "
                         f"{engine.max_model_len}]")
    gen = torch.Generator().manual_seed(0)
    vocab = engine.snapshot().model.vocab_size
    prompts = torch.randint(0, vocab, (n, tokens), generator=gen).tolist()
    engine.embed(prompts[:args.batch])
    start = time.perf_counter()
    for i in range(0, n, args.batch):
        engine.embed(prompts[i:i + args.batch])
    seconds = time.perf_counter() - start
    params = sum(layer.dense_params for layer in engine.snapshot().spec.layers)
    flops = 2 * params * n * tokens / seconds
    print(f"{engine.model_name}: {n} inputs x {tokens} tokens in {seconds:.2f} s "
          f"(batches of {args.batch}, --threads {args.threads or 'default'}): "
          f"{n / seconds:.1f} sequences/s, "
          f"{n * tokens / seconds:.0f} tokens/s, {flops / 1e9:.1f} GFLOP/s in the "
          "layers' weight products")
    return 0
