"""`kvlab kv-quality`: KL divergence of next-token distributions, each KV dtype vs f32;
with `--kernels`, the quantized decode kernels vs the same weights dequantized to fp32."""

from __future__ import annotations

import argparse

import torch

from kvlab.cli.common import add_model_flags, engine_config
from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.harness.kv_quality import compare_kv_dtypes, format_quality, kv_quality
from kvlab.models.kv_store import KV_DTYPES


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("kv-quality", help="output drift of KV cache dtypes against f32")
    p.add_argument("--positions", type=int, default=300, help="teacher-forced positions")
    p.add_argument("--compare", default="f16,bf16,q8_0", help="KV dtypes to measure")
    p.add_argument("--keep-quantized", action="store_true",
                   help="run the quantized kernels instead of dequantized weights")
    p.add_argument("--kernels", action="store_true",
                   help="instead: quantized kernels against dequantized fp32 weights")
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
    if args.kernels:
        return _kernels(args)
    base = Engine.from_model(args.model, engine_config(args, kv_dtype="f32",
                                                       keep_quantized=keep))
    print(f"{base.model_name}: {args.positions} teacher-forced decode positions, "
          f"{'quantized' if keep else 'dequantized fp32'} weights, reference: f32 KV cache")
    print(kv_quality(base, dtypes, args.positions))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    dense = Engine.from_model(args.model, engine_config(args, kv_dtype="f32",
                                                        keep_quantized=False))
    quantized = Engine.from_model(args.model, engine_config(args, kv_dtype="f32"))
    print(f"{dense.model_name}: {args.positions} teacher-forced decode positions, "
          "reference: weights dequantized to fp32 (dense products)")
    with torch.inference_mode():
        rows = compare_kv_dtypes(dense, {"kernels": quantized}, args.positions)
    print(format_quality(rows, dense.cost.kv_bytes_per_token))
    return 0
