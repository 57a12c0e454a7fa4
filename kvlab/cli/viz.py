"""`kvlab viz`: start the server and print the URL of the live visualiser (/viz).

The same server as `kvlab serve` (the OpenAI API stays available beside the page); the
visualiser's event stream and what-if endpoint are described in docs/viz.md.
"""

from __future__ import annotations

import argparse

from kvlab.cli.common import add_model_flags, engine_config
from kvlab.engine import Engine
from kvlab.server.apis import front_ends
from kvlab.server.core.app import serve


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("viz", help="a live web view of prefill, decode and the KV cache",
                        description=__doc__)
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="most requests in the running batch")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = engine_config(args, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                           enable_prefix_caching=not args.no_prefix_caching,
                           record_experts=True)  # MoE models: which experts each token ran
    engine = Engine.from_model(args.model, config)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"kvlab viz: {engine.model_name} — open http://{host}:{args.port}/viz "
          "(Ctrl-C to stop)", flush=True)
    serve(engine, args.host, args.port, log_level=args.log_level, front_ends=front_ends())
    return 0

