"""`kvlab kv-quality`: KL divergence of next-token distributions, each KV dtype vs f32."""

from __future__ import annotations

import argparse

from kvlab.bench.kv_quality import kv_quality
from kvlab.cli.common import add_model_flags, engine_config
from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.models.kv_store import KV_DTYPES


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("kv-quality", help="output drift of KV cache dtypes against f32")
    p.add_argument("--positions", type=int, default=300, help="teacher-forced positions")
    p.add_argument("--compare", default="f16,bf16,q8_0", help="KV dtypes to measure")
    p.add_argument("--keep-quantized", action="store_true",
                   help="run the quantized kernels instead of dequantized weights")
    add_model_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dtypes = [d for d in args.compare.split(",") if d]
    bad = [d for d in dtypes if d not in KV_DTYPES]
    if bad or args.positions < 1:
        raise KvlabError(f"--compare takes {', '.join(KV_DTYPES)} and --positions >= 1; "
                         f"got {args.compare!r}, {args.positions}")
    # dense weights by default: the int8 activation rounding of the quantized kernels turns
    # any small perturbation into noise of its own size, which would hide the KV effect
    keep = args.keep_quantized
    base = Engine.from_model(args.model, engine_config(args, kv_dtype="f32",
                                                       keep_quantized=keep))
    print(f"{base.model_name}: {args.positions} teacher-forced decode positions, "
          f"{'quantized' if keep else 'dequantized fp32'} weights, reference: f32 KV cache")
    print(kv_quality(base, dtypes, args.positions))
    return 0
