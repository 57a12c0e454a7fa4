"""`kvlab serve`: an OpenAI-compatible HTTP server (completions, chat, models, metrics)."""

from __future__ import annotations

import argparse
import sys

from kvlab.cli.common import add_model_flags, engine_config


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="most requests in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (prefill chunks + decodes)")
    p.add_argument("--max-waiting", type=int, default=128,
                   help="requests that may wait beyond the running batch; more get 503")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.engine import Engine
    from kvlab.errors import KvlabError
    from kvlab.server import serve

    if args.max_waiting < 0 or args.max_num_batched_tokens < 1:
        raise KvlabError("--max-waiting must be >= 0 and --max-num-batched-tokens >= 1")
    config = engine_config(args, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           block_size=args.block_size,
                           enable_prefix_caching=not args.no_prefix_caching)
    engine = Engine.from_model(args.model, config)
    print(f"kvlab serve: {engine.model_name} (context {engine.max_model_len}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve(engine, args.host, args.port, args.max_waiting, args.shutdown_timeout,
          args.log_level)
    return 0
