"""Decode attention on DeepSeek's latent cache, one layer: kvlab's C latent attention
(fused.mla_decode: q_nope through W_UK, the paged attention over the latent rows, the latent
sum through W_UV, all in C) against the same attention with W_UK and W_UV as torch bmm
around the C paged attention (the form the per-op path took before). Prints per shape the
ms per call of each, their ratio, and the bytes (latent rows + W_UK + W_UV) and FLOPs the C
call reached per second.

    .venv/bin/python bench/mla_attention.py [--repeat 20] [--contexts 512 4096]

Shapes: DeepSeek-V3 / R1 / Kimi K2's layer (128 heads, nope 128, rope 64, rank 512, vdim 128)
and V2-Lite's (16 heads, same widths); the latent store fp32, each sequence's slots
scattered over the pool.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlab.kernels import fused

SHAPES = {"v3": (128, 128, 64, 512, 128), "v2-lite": (16, 128, 64, 512, 128)}


def _best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _torch_absorbed(q, store, w_uk, w_uv_t, slots, scale, lengths):
    _, nope, rank = w_uk.shape
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)
    queries = torch.cat([q_lat, q[..., nope:]], dim=-1).contiguous()
    out = fused.attend_decode(queries, store, store, slots, scale, lengths)[..., :rank]
    return torch.bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(len(q), -1)


def row(name: str, batch: int, context: int, repeat: int) -> str:
    heads, nope, rope, rank, vdim = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    w_uk = torch.randn(heads, nope, rank, generator=g) / rank ** 0.5
    w_uv_t = torch.randn(heads, rank, vdim, generator=g) / rank ** 0.5
    store = torch.randn(batch * context + 64, 1, rank + rope, generator=g)
    slots = torch.randperm(store.shape[0], generator=g)[:batch * context].view(batch, context)
    lengths = torch.full((batch,), context)
    q = torch.randn(batch, heads, nope + rope, generator=g)
    scale = (nope + rope) ** -0.5
    c_ms = _best_ms(lambda: fused.mla_decode(q, store, w_uk, w_uv_t, slots, scale, lengths),
                    repeat)
    t_ms = _best_ms(lambda: _torch_absorbed(q, store, w_uk, w_uv_t, slots, scale, lengths),
                    repeat)
    width = rank + rope
    nbytes = 4 * (batch * context * width + heads * rank * (nope + vdim))
    flop = 2 * batch * heads * (nope * rank + 2 * context * width + rank * vdim)
    return (f"{name:<8} B {batch:>2} C {context:>5}  C {c_ms:8.2f} ms  torch bmm {t_ms:8.2f} ms  "
            f"ratio {t_ms / c_ms:5.2f}  {nbytes / c_ms / 1e6:6.1f} GB/s  "
            f"{flop / c_ms / 1e6:7.1f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if not fused.ENABLED:
        raise SystemExit("kvlab's C extension is not built")
    for name in SHAPES:
        for batch in args.batches:
            for context in args.contexts:
                print(row(name, batch, context, args.repeat), flush=True)


if __name__ == "__main__":
    main()
