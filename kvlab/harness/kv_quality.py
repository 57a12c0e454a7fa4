"""What a smaller KV cache dtype costs in output quality: KL divergence of next-token
distributions against an f32 cache, teacher-forced along the same text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine import Engine

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; stored programs let instructions live in memory beside data, and "
    "assemblers gave names to numbers. Compilers then translated structured languages into "
    "machine code, operating systems shared one processor among many programs, and networks "
    "joined machines into systems larger than any one of them. Each layer hid the details of "
    "the one below, so that people could think about problems instead of circuits. Today a "
    "language model runs on that whole tower: its weights sit in memory, its arithmetic runs "
    "on vector units or graphics processors, and its answers stream over the network one "
    "token at a time. Understanding where the time goes means looking through the layers "
    "again: how many bytes each step must read, how many operations it performs, and which "
    "of the two the hardware runs out of first. A decode step reads every weight once, so "
    "memory bandwidth sets its pace; a prefill pass multiplies large matrices, so arithmetic "
    "throughput sets it. Caches, batching and quantization are all ways to move one of those "
    "limits, and measuring before and after is the only way to know that they did."
)


@dataclass(frozen=True)
class KVQuality:
    kv_dtype: str
    positions: int
    kl_mean: float  # nats, KL(f32 || this dtype) per position
    kl_max: float
    top1_agreement: float
    kv_bytes_per_token: int


def compare_kv_dtypes(reference: Engine, others: dict[str, Engine], positions: int,
                      prefill: int = 16) -> list[KVQuality]:
    ids = reference.tokenizer.encode(TEXT)
    while len(ids) < prefill + positions:
        ids += reference.tokenizer.encode(" " + TEXT, add_special_tokens=False)
    ids = ids[:prefill + positions]
    ref = reference.teacher_forced_logprobs(ids, prefill)
    results = []
    for name, engine in others.items():
        got = engine.teacher_forced_logprobs(ids, prefill)
        kl = (ref.exp() * (ref - got)).sum(-1)
        agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
        results.append(KVQuality(name, ref.shape[0], float(kl.mean()), float(kl.max()),
                                 float(agree), engine.cost.kv_bytes_per_token))
    return results


def format_quality(rows: list[KVQuality], reference_bytes: int) -> str:
    lines = [(f"{'variant':<8} {'bytes/token':>12} {'vs f32':>7} {'KL mean':>10} "
             f"{'KL max':>10} {'top-1 agree':>12}")]
    for r in rows:
        lines.append(f"{r.kv_dtype:<8} {r.kv_bytes_per_token:>12,} "
                     f"{r.kv_bytes_per_token / reference_bytes:>7.3f} {r.kl_mean:>10.2e} "
                     f"{r.kl_max:>10.2e} {100 * r.top1_agreement:>11.1f}%")
    return "\n".join(lines)


def engines_for(base: Engine, dtypes: list[str]) -> dict[str, Engine]:
    """Engines sharing `base`'s loaded weights, one per KV dtype."""
    from dataclasses import replace

    return {d: Engine(base.loaded, base.tokenizer, replace(base.config, kv_dtype=d),
                      base.model_name) for d in dtypes}


def kv_quality(base: Engine, dtypes: list[str], positions: int) -> str:
    with torch.inference_mode():
        rows = compare_kv_dtypes(base, engines_for(base, dtypes), positions)
    return format_quality(rows, base.cost.kv_bytes_per_token)
