"""`kvlab loadtest`: stream requests at an OpenAI-compatible server and report TTFT, TPOT, ITL,
E2E latency, throughput and goodput; `--sweep` repeats it over concurrencies and plots;
`--json-schema` constrains every reply and counts the valid ones and the forced tokens;
`--estimate` predicts every level for kvlab serving the model on this machine and prints the
prediction beside the measurement (kvlab.estimate.serving_check)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys

from kvlab.cli.loadtest_estimate import predictor
from kvlab.errors import KvlabError
from kvlab.estimate.serving_check import as_dict, format_check
from kvlab.harness import loadtest as lt
from kvlab.harness.loadtest import LoadConfig, load_schema


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("loadtest", help="load test an OpenAI-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (with or without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", "-c", type=int, default=None,
                      help="requests in flight (closed loop; default 1)")
    load.add_argument("--rate", type=float, default=None,
                      help="Poisson arrival rate in requests/s (open loop)")
    load.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,4,8")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="with --rate: cap on requests in flight")
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--prompts", default=None, help="JSONL file: {\"prompt\"} or {\"messages\"}")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly max_tokens (vLLM / llama.cpp extension)")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="send this JSON schema as response_format; report valid replies and "
                        "the share of forced output tokens")
    p.add_argument("--slo", action="append", default=[],
                   help="SLO for goodput, KEY:MS with KEY in ttft, tpot, e2el (repeatable)")
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", default=None, help="with --sweep: write a PNG plot here")
    add_estimate_args(p)
    p.set_defaults(func=run)


def add_estimate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prediction (--estimate)")
    g.add_argument("--estimate", action="store_true",
                   help="predict each level from `kvlab probe`'s figures for kvlab serving "
                        "the model here, and print it beside the measurement")
    g.add_argument("--estimate-model", metavar="FILE.gguf",
                   help="the served model's GGUF file (default: the default model)")
    g.add_argument("--server-max-num-seqs", type=int, default=16, metavar="N",
                   help="the server's --max-num-seqs (16)")
    g.add_argument("--server-max-num-batched-tokens", type=int, default=512, metavar="N",
                   help="the server's --max-num-batched-tokens (512)")
    g.add_argument("--server-kv-dtype", default="auto", metavar="DTYPE",
                   help="the server's --kv-dtype (auto: f16 on CPUs, as kvlab serve's)")


def _levels(spec: str) -> list[int]:
    try:
        levels = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise KvlabError(f"--sweep {spec!r}: expected integers such as 1,4,8,16") from None
    if not levels or min(levels) < 1:
        raise KvlabError(f"--sweep {spec!r}: concurrencies must be >= 1")
    return levels


def _config(args: argparse.Namespace):
    if args.num_requests < 1 or args.max_tokens < 1:
        raise KvlabError("--num-requests and --max-tokens must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise KvlabError("--concurrency must be >= 1")
    if args.rate is not None and args.rate <= 0:
        raise KvlabError("--rate must be > 0")
    concurrency = args.concurrency or (args.max_concurrency if args.rate else 1)
    return LoadConfig(
        url=args.url, model=args.model, endpoint=args.endpoint, concurrency=concurrency,
        rate=args.rate, num_requests=args.num_requests, max_tokens=args.max_tokens,
        temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
        timeout=args.timeout, api_key=os.environ.get("OPENAI_API_KEY"),
        json_schema=load_schema(args.json_schema) if args.json_schema else None)


def _predictor(args: argparse.Namespace):
    """The prediction's inputs with --estimate (checked before any load is sent), else None."""
    if not args.estimate:
        return None

    return predictor(args)


def run(args: argparse.Namespace) -> int:
    if args.plot and not args.sweep:
        raise KvlabError("--plot needs --sweep")
    cfg = _config(args)
    slos = lt.parse_slos(args.slo)
    prompts = lt.load_prompts(args.prompts) if args.prompts else lt.builtin_prompts()
    levels = _levels(args.sweep) if args.sweep else [cfg.concurrency]
    predictor = _predictor(args)
    runs, checks = [], []
    for level in levels:
        run_cfg = dataclasses.replace(cfg, concurrency=level)
        results, seconds, model = asyncio.run(lt.run_load(run_cfg, prompts, args.warmup))
        runs.append(lt.summarize(run_cfg, model, results, seconds, slos))
        if predictor is not None and runs[-1].completed:
            checks.append((level or 0, predictor.level(run_cfg, results), runs[-1]))
        if not args.json:
            print(lt.format_summary(runs[-1]), flush=True)
    if args.sweep and not args.json:
        print("\n" + lt.format_sweep(runs))
    if predictor is not None and checks and not args.json:
        print("\n" + format_check(predictor, checks))
    if args.plot:
        lt.plot_sweep(runs, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        records = [s.as_dict() for s in runs]
        if predictor is not None:
            predicted = {level: as_dict(pred) for level, pred, _ in checks}
            for record in records:
                record["predicted"] = predicted.get(record["concurrency"] or 0)
        print(json.dumps({"sweep": records} if args.sweep else records[0], indent=2))
    return 1 if all(s.completed == 0 for s in runs) else 0
