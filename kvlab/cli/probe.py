"""`kvlab probe`: measure this machine's memory bandwidth and matmul FLOP/s, and cache them
for `kvlab estimate --hardware this`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from kvlab.perf.probe import probe, save_probe


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "probe", help="measure memory bandwidth and FLOP/s for `estimate --hardware this`",
        description=__doc__)
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch threads to measure with (default: torch's own choice)")
    p.add_argument("--bf16", action="store_true", help="also measure bf16 matmul FLOP/s")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = probe(threads=args.threads, bf16=args.bf16)
    path = save_probe(result)
    if args.json:
        print(json.dumps({**asdict(result), "cache": str(path)}, indent=2))
        return 0
    print(f"probed {result.cpu} with {result.threads} threads")
    rows = [("memory read bandwidth", f"{result.bandwidth_gbs:,.1f} GB/s",
             result.details["bandwidth"])]
    rows += [(f"matmul {dtype}", f"{tf * 1000:,.1f} GFLOP/s", result.details[dtype])
             for dtype, tf in result.tflops.items()]
    rows.append(("memory", f"{result.memory_gib:,.1f} GiB", result.details["memory"]))
    for name, value, how in rows:
        print(f"{name:<22} {value:>15}   {how}")
    print(f"cached to {path} for `kvlab estimate --hardware this`")
    return 0
