"""`kvlab serve`: an HTTP server speaking the OpenAI and Ollama APIs on one port (completions,
chat, models, metrics); `--ollama` listens where Ollama's clients look (port 11434).

With `--replicas N` (or `--min-replicas/--max-replicas`) the same API is served by N engine
replicas under Ray Serve (kvlab.server.replicas); `--threads` is then per replica.
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import urlsplit

from kvlab.cli.common import (
    add_model_flags,
    add_speculative_flags,
    engine_config,
    speculative_config,
)
from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.server.apis import front_ends
from kvlab.server.core.app import serve
from kvlab.server.core.guard import ServerLimits
from kvlab.server.replicas.settings import AppSettings


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("serve", help="serve the model over the OpenAI and Ollama HTTP APIs")
    add_model_flags(p)
    add_speculative_flags(p)
    p.add_argument("--host", default=None,
                   help="address to listen on (default 127.0.0.1, or $OLLAMA_HOST's with "
                        "--ollama)")
    p.add_argument("--port", type=int, default=None,
                   help="default 8000; with --ollama, Ollama's 11434 (or $OLLAMA_HOST's)")
    p.add_argument("--ollama", action="store_true",
                   help="listen where Ollama's clients look: $OLLAMA_HOST when set, else "
                        "127.0.0.1:11434 (every API is served on the one port either way)")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="most requests in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (prefill chunks + decodes)")
    p.add_argument("--max-waiting", type=int, default=128,
                   help="requests that may wait beyond the running batch; more get 503")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-reserve-kv", action="store_true",
                   help="let KV pool pages become resident as sequences reach them (a pager "
                        "thread faults them in half a page ahead); by default the whole pool "
                        "is touched at start, as llama-server does, so memory is claimed up "
                        "front and stays flat under load")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may finish after SIGINT/SIGTERM")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body in bytes; larger ones get 413 unread (4 MiB)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take; at the deadline its choices end where "
                        "they are (finish_reason 'length') and free their KV blocks")
    p.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="thinking models: reasoning tokens a reply may write before its end "
                        "marker (`</think>`) is forced; none by default")
    p.add_argument("--api-key", default=os.environ.get("KVLAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every API "
                        "route (default: $KVLAB_API_KEY; none: open)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="require the API key on /health and /metrics too")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may ask for; the first is the one /v1/models shows "
                        "and answers carry (default: the model file's name)")
    p.add_argument("--any-model-name", action="store_true",
                   help="answer whatever model name a client sends (for tools that hard-code "
                        "one); by default an unknown name is a 404")
    p.add_argument("--responses-max-stored", type=int, default=512, metavar="N",
                   help="Responses API: stored responses kept for previous_response_id and "
                        "GET; the oldest is dropped first")
    p.add_argument("--responses-max-age", type=float, default=3600.0, metavar="S",
                   help="Responses API: seconds a stored response is kept")
    p.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="web pages (origins such as http://localhost:3000) whose browsers may "
                        "call the API (CORS, preflights answered); none by default; '*' "
                        "needs --api-key")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_replica_flags(p)
    p.set_defaults(func=run)


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve with N engine replicas under Ray Serve (--threads each)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale between --min-replicas and --max-replicas")
    g.add_argument("--max-replicas", type=int, default=None)
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of requests in flight per replica "
                        "(default: half of --max-num-seqs)")
    g.add_argument("--routing", choices=("prefix", "round-robin", "pow2"), default="prefix",
                   help="which replica a request goes to: the one its prompt's leading KV "
                        "blocks hash to (spilling over when it is busy), each in turn, or "
                        "Serve's power of two choices")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one)")


def run(args: argparse.Namespace) -> int:
    args.host, args.port = listen_address(args)
    if args.max_waiting < 0 or args.max_num_batched_tokens < 1:
        raise KvlabError("--max-waiting must be >= 0 and --max-num-batched-tokens >= 1")
    if replicated(args) and args.tensor_parallel_size > 1:
        raise KvlabError("--replicas with --tensor-parallel-size > 1 is not supported: run "
                         "replicas of a whole model, or one server over the ranks")
    if replicated(args):
        try:  # Ray Serve is an optional extra: imported only when replicas are asked for
            from kvlab.server.replicas.application import launch
        except ImportError as e:
            raise KvlabError(f"--replicas needs Ray Serve ({e}): pip install 'kvlab[replicas]'"
                             ) from None
        launch(app_settings(args), args.host, args.port, args.ray_address, args.log_level)
        return 0
    limits = server_limits(args)
    config = engine_config(args, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           block_size=args.block_size,
                           enable_prefix_caching=not args.no_prefix_caching,
                           **speculative_config(args))
    engine = Engine.from_model(args.model, config)
    if not args.no_reserve_kv:
        engine.reserve_kv_memory()
    print(f"kvlab serve: {engine.model_name} (context {engine.max_model_len}) on "
          f"http://{args.host}:{args.port} (OpenAI /v1, Ollama /api)", file=sys.stderr, flush=True)
    if limits.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvlab serve: WARNING: listening on {args.host} without an API key: anyone who "
              "can reach this port can use the model (set --api-key or KVLAB_API_KEY)",
              file=sys.stderr, flush=True)
    serve(engine, args.host, args.port, args.max_waiting, args.shutdown_timeout,
          args.log_level, front_ends=front_ends(), limits=limits)
    return 0


def listen_address(args: argparse.Namespace) -> tuple[str, int]:
    """--host / --port, else Ollama's address with --ollama, else 127.0.0.1:8000."""
    host, port = ollama_address(os.environ.get("OLLAMA_HOST", "")) if args.ollama \
        else ("127.0.0.1", 8000)
    return args.host or host, port if args.port is None else args.port


def ollama_address(value: str) -> tuple[str, int]:
    """OLLAMA_HOST as Ollama reads it: [http[s]://]host[:port]; 127.0.0.1:11434 by default
    (port 80 / 443 when only a scheme is given), so `ollama` clients reading the same
    variable find the server."""
    scheme, _, rest = value.strip().rpartition("://")
    try:
        url = urlsplit("//" + rest.rstrip("/"))
        port = url.port
    except ValueError:
        raise KvlabError(f"OLLAMA_HOST must be [http://]host[:port], got {value!r}") from None
    default = {"http": 80, "https": 443}.get(scheme.lower(), 11434)
    return url.hostname or "127.0.0.1", default if port is None else port


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The front-door settings from the flags; a bad value is a one-line error."""
    if args.api_key is not None and not args.api_key.strip():
        raise KvlabError("--api-key / KVLAB_API_KEY is empty; give a key or unset it")
    return ServerLimits(max_request_bytes=args.max_request_bytes, api_key=args.api_key,
                        protect_metrics=args.protect_metrics,
                        request_timeout=args.request_timeout,
                        allowed_origins=tuple(args.allowed_origins),
                        served_model_names=tuple(args.served_model_name or ()),
                        any_model_name=args.any_model_name,
                        responses_max_stored=args.responses_max_stored,
                        responses_max_age_s=args.responses_max_age,
                        reasoning_budget=args.reasoning_budget)


def replicated(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.max_replicas is not None \
        or args.min_replicas is not None


def app_settings(args: argparse.Namespace) -> AppSettings:
    """The replicated application from the flags; --threads defaults to a share of the CPUs."""
    most = args.max_replicas or args.replicas or 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, most))
    config = engine_config(args, threads=threads, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           block_size=args.block_size,
                           enable_prefix_caching=not args.no_prefix_caching,
                           **speculative_config(args))
    return AppSettings(model=args.model, engine=config, limits=server_limits(args),
                       max_waiting=args.max_waiting, reserve_kv=not args.no_reserve_kv,
                       replicas=1 if args.replicas is None else args.replicas,
                       min_replicas=args.min_replicas,
                       max_replicas=args.max_replicas,
                       target_ongoing_requests=args.target_ongoing_requests,
                       routing=args.routing)
