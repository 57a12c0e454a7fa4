"""kvlab against llama.cpp on an OLMoE-1B-7B-shaped mixture-of-experts model (Q4_K_M).

    .venv/bin/python bench/moe_peers.py [-t 2] [-r 3] [-p 512] [-n 128] [--layers 16]
        [--types Q4_K_M] [--workdir /tmp/kvlab-moe-peers] [--llama-bin DIR]

Steps, each skipped when its output already exists in --workdir:
  1. write a random-weight F16 GGUF (architecture `olmoe`) with OLMoE-1B-7B's shape: 16
     layers, hidden 2048, 16 heads of 128 (no GQA), QK-norm over the whole q/k projections,
     64 experts of FFN 1024, 8 per token, untied output; routers and norms in F32 as llama.cpp's
     converter keeps them; the Llama 3 tokenizer from llama.cpp's vocabulary file (128256
     tokens where OLMoE has 50304: the embedding and head are larger than the real model's);
     --layers writes fewer layers (the F16 file is ~13 GB at 16);
  2. quantize it with llama-quantize to each of --types.
The writer (MoeShape, write_moe_gguf) also writes qwen2moe (shared expert and its sigmoid
gate, q/k/v bias), qwen3moe (per-head QK-norm, GQA) and Mixtral (`llama` with experts)
layouts, and (ensure_quantized) a quantized file directly as random blocks of the types
llama-quantize --dry-run picks: bench/shapes_vs_llamabench.py's `moe` area builds the
published shapes that way.
Then `kvlab bench` and `llama-bench` run alternately on each file, as bench/quant_peers.py
does (its helpers are imported), and the report prints median pp/tg tok/s, the ratio and the
decode ceiling: bandwidth over the bytes a batch-1 step reads as stored (attention, routers,
norms, the output matrix and 8 of the 64 experts per layer, plus the f16 KV cache).
"""

from __future__ import annotations

import argparse
import functools
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_peers as qp  # the sibling scripts' helpers, by path
from planned_gguf import add_file_type, ensure_planned, write_gguf


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts checkpoint's config.json, the fields a GGUF carries (vocab: the
    tokenizer's); the defaults are OLMoE-1B-7B-0924's. `arch` is the GGUF architecture
    llama.cpp's converter writes (Mixtral: `llama` with experts)."""

    arch: str = "olmoe"
    name: str = "olmoe-1b-7b"
    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    experts: int = 64
    experts_used: int = 8
    expert_ffn: int = 1024
    ffn: int = 1024  # intermediate_size: the converter's feed_forward_length
    shared_ffn: int = 0  # a shared expert every token runs, scaled by a sigmoid gate
    qk_norm: str = "whole"  # "whole": over the q/k projections; "head": per head; "": none
    qkv_bias: bool = False
    vocab: int = 128256
    context: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5


def moe_tensors(s: MoeShape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor, in llama.cpp's names; experts stacked
    [experts, out, in]; the shared expert's gate is a vector [hidden], as llama.cpp loads it."""
    d, e, f, sf = s.hidden, s.experts, s.expert_ffn, s.shared_ffn
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = [("attn_norm.weight", (d,)), ("attn_q.weight", (q, d)), ("attn_k.weight", (kv, d)),
             ("attn_v.weight", (kv, d)), ("attn_output.weight", (d, q))]
    if s.qkv_bias:
        layer += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
    if s.qk_norm:
        q_len, k_len = (q, kv) if s.qk_norm == "whole" else (s.head_dim, s.head_dim)
        layer += [("attn_q_norm.weight", (q_len,)), ("attn_k_norm.weight", (k_len,))]
    layer += [("ffn_norm.weight", (d,)), ("ffn_gate_inp.weight", (e, d)),
              ("ffn_gate_exps.weight", (e, f, d)), ("ffn_up_exps.weight", (e, f, d)),
              ("ffn_down_exps.weight", (e, d, f))]
    if sf:
        layer += [("ffn_gate_inp_shexp.weight", (d,)), ("ffn_gate_shexp.weight", (sf, d)),
                  ("ffn_up_shexp.weight", (sf, d)), ("ffn_down_shexp.weight", (d, sf))]
    tensors = [("token_embd.weight", (s.vocab, d))]
    tensors += [(f"blk.{i}.{name}", shape) for i in range(s.layers) for name, shape in layer]
    return tensors + [("output_norm.weight", (d,)), ("output.weight", (s.vocab, d))]


def _is_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or "ffn_gate_inp" in name  # the converter keeps routers F32


def tensor_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Norms 1.0; matrices N(0, 0.02) in f16 (stacked experts one expert at a time); routers
    (the shared expert's gate vector too) and biases N(0, 0.02) in f32."""
    if len(shape) == 3:
        return np.stack([qp.tensor_values(name, shape[1:], qp.LlamaShape(), seed * 1000 + e)
                         for e in range(shape[0])])
    if len(shape) == 1 and "norm" not in name:
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.02
    values = qp.tensor_values(name, shape, qp.LlamaShape(), seed)
    return values.astype(np.float32) if _is_f32(name, shape) else values


def write_moe_gguf(path: Path, vocab_file: Path, s: MoeShape, ftype: str = "F16",
                   types: dict[str, str] | None = None, sparse: bool = False) -> None:
    """Stream the model to `path` (planned_gguf.write_gguf): F16 matrices, or with `types`
    (tensor name -> ggml type name, a plan for the file type `ftype`) random blocks of each
    tensor's type; `sparse`: a skeleton for llama-quantize --dry-run."""

    def add_keys(w) -> None:
        _moe_metadata(w, s, ftype)
        qp.copy_tokenizer(w, vocab_file, s.vocab)

    write_gguf(path, s.arch, add_keys, moe_tensors(s), _is_f32, tensor_values, types, sparse)


def _moe_metadata(w, s: MoeShape, ftype: str) -> None:
    """The keys llama.cpp's converter writes for the family (and llama-quantize's for a
    quantized `ftype`); the expert FFN lengths only where they differ from
    intermediate_size, as the converter does."""
    w.add_string("general.name", f"{s.name}-shaped, {s.layers} layers (random weights)")
    add_file_type(w, ftype)
    keys = [("block_count", s.layers), ("context_length", s.context),
            ("embedding_length", s.hidden), ("feed_forward_length", s.ffn),
            ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
            ("attention.key_length", s.head_dim), ("attention.value_length", s.head_dim),
            ("rope.dimension_count", s.head_dim), ("vocab_size", s.vocab),
            ("expert_count", s.experts), ("expert_used_count", s.experts_used)]
    if s.expert_ffn != s.ffn:
        keys.append(("expert_feed_forward_length", s.expert_ffn))
    if s.shared_ffn:
        keys.append(("expert_shared_feed_forward_length", s.shared_ffn))
    for key, value in keys:
        w.add_uint32(f"{s.arch}.{key}", value)
    w.add_float32(f"{s.arch}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{s.arch}.attention.layer_norm_rms_epsilon", s.rms_eps)


def f16_bytes(s: MoeShape) -> int:
    return sum(math.prod(shape) * (4 if _is_f32(name, shape) else 2)
               for name, shape in moe_tensors(s))


def ensure_f16(path: Path, vocab_file: Path, s: MoeShape) -> Path:
    """The F16 file at `path`, written unless it exists; refused when the disk lacks room
    for it and for a quantized copy of a third of its size."""
    if path.exists():
        print(f"# have {path}")
        return path
    need, free = f16_bytes(s), shutil.disk_usage(path.parent).free
    if free < need * 4 // 3:
        raise qp.QuantizeFailed(f"{path.name} needs ~{need * 4 / 3e9:.1f} GB with its "
                                f"quantized copy; {path.parent} has {free / 1e9:.1f} GB free")
    print(f"# writing {path} ({s.layers} layers, ~{need / 1e9:.1f} GB of random weights)",
          flush=True)
    start = time.perf_counter()
    write_moe_gguf(path, vocab_file, s)
    print(f"#   done in {time.perf_counter() - start:.0f} s")
    return path


def ensure_quantized(path: Path, vocab_file: Path, s: MoeShape, ftype: str,
                     llama_bin: Path) -> Path:
    """The `ftype` file at `path` written directly as random blocks, each tensor of the type
    llama-quantize would give it (bench/planned_gguf.py): the file a quantized checkpoint of
    this shape has, without an F16 copy on disk or llama-quantize's pass over it (~35 min
    for OLMoE on two busy cores)."""
    write = functools.partial(write_moe_gguf, vocab_file=vocab_file, s=s)
    return ensure_planned(path, ftype, llama_bin, moe_tensors(s), write, _is_f32)


def moe_step_bytes(model: Path, context: int, arch: str = "olmoe") -> float:
    """Bytes a batch-1 decode step reads with the weights as stored: every tensor but the
    embedding (one row) and the routed experts (experts_used of expert_count), plus an f16
    KV cache of `context` tokens; `arch` is the GGUF's architecture (its keys' prefix)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    meta = {k[len(arch) + 1:]: f.contents() for k, f in reader.fields.items()
            if k.startswith(f"{arch}.")}
    share = meta["expert_used_count"] / meta["expert_count"]
    total = 0.0
    for t in reader.tensors:
        n = int(t.n_bytes)
        total += n * share if "_exps" in t.name else (n / t.shape[-1]
                                                       if t.name == "token_embd.weight" else n)
    kv = meta["block_count"] * meta["attention.head_count_kv"] * 2 * \
        meta["attention.key_length"] * 2
    return total + kv * context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    qp.add_run_args(ap, "Q4_K_M", "/tmp/kvlab-moe-peers")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (OLMoE: 16)")
    args = ap.parse_args(argv)
    qp.check_run_args(ap, args, [])
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engines: list[qp.Engine] = [qp.KvlabBench(), qp.LlamaBench("llama.cpp", args.llama_bin)]
    bandwidth = qp.print_header(engines, args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    f16 = args.workdir / f"olmoe-1b-7b-shape-{args.layers}L-F16.gguf"
    files = []
    try:
        ensure_f16(f16, args.vocab, MoeShape(layers=args.layers))
    except qp.QuantizeFailed as e:
        raise SystemExit(str(e)) from None
    for qtype in (t.strip() for t in args.types.split(",") if t.strip()):
        try:
            files.append(qp.quantize(f16, qtype, args.llama_bin))
        except qp.QuantizeFailed as e:
            print(f"# {e}")
    for model in files:
        series = qp.bench_file(model, engines, args)
        qp.report(model, series, bandwidth, args, moe_step_bytes(model, args.n // 2 + 1))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
