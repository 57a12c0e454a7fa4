"""kvlab against llama.cpp on a gpt-oss-20b-shaped mixture-of-experts model, MXFP4 experts.

    .venv/bin/python bench/moe_families_peers.py [-t 2] [-r 3] [-p 512] [-n 128] [--layers 24]
        [--others q8_0] [--workdir /tmp/kvlab-moe-families] [--llama-bin DIR] [--vocab FILE]

Step, skipped when its output already exists in --workdir: write a random-weight GGUF
(architecture `gpt-oss`) with gpt-oss-20b's shape: 24 layers, hidden 2880, 64 query heads
and 8 KV heads of 64, q/k/v/o biases, a sink logit per head, sliding-window (128) layers by
turns with full ones, YaRN (x32 over 4096), 32 experts of FFN 2880, 4 per token, a biased
router, biased experts with the clamped SwiGLU; the experts as MXFP4 blocks (random nibbles,
one E8M0 scale per 32: the type of OpenAI's release and of llama.cpp's conversion), the
other matrices random Q8_0 blocks (--others f16: F16 N(0, 0.02), which kvlab holds in fp32
and runs per op, outside its one-call decode), norms, biases, sinks and routers F32, as
llama.cpp's converter keeps them. The tokenizer is the Llama 3 one from llama.cpp's vocabulary file (128256 tokens where
gpt-oss has 201088: the embedding and head are smaller than the real model's). --layers
writes fewer layers (~0.5 GB a layer).

Then `kvlab bench` and `llama-bench` run alternately on the file, as bench/quant_peers.py
does (its helpers are imported), and the report prints median pp/tg tok/s, the ratio and
the decode ceiling: bandwidth over the bytes a batch-1 step reads as stored (everything
but the embedding and 4 of the 32 experts per layer, plus the f16 KV cache).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_peers  # the sibling scripts' helpers, by path
import quant_peers as qp

ARCH = "gpt-oss"
MXFP4 = 39  # gguf.GGMLQuantizationType.MXFP4: blocks of 32 in 17 bytes (E8M0 scale, nibbles)
MXFP4_SCALE = 119  # E8M0 2^-8: random nibbles give weights of about gpt-oss's scale
Q8_0 = 8  # blocks of 32 in 34 bytes: an f16 scale, 32 int8
Q8_0_SCALE = np.float16(0.02 * 3 / 127)  # int8 in [-127, 127] spans N(0, 0.02)'s 3 sigma


@dataclass(frozen=True)
class GptOssShape:
    """gpt-oss-20b's config.json, the fields a GGUF carries (vocab: the tokenizer's)."""

    layers: int = 24
    hidden: int = 2880
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    experts: int = 32
    experts_used: int = 4
    expert_ffn: int = 2880
    vocab: int = 128256
    context: int = 131072
    sliding_window: int = 128
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original: int = 4096
    rms_eps: float = 1e-5


def gpt_oss_tensors(s: GptOssShape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor, in llama.cpp's names; experts stacked
    [experts, out, in]."""
    d, e, f, q, kv = s.hidden, s.experts, s.expert_ffn, s.heads * s.head_dim, \
        s.kv_heads * s.head_dim
    tensors = [("token_embd.weight", (s.vocab, d))]
    for i in range(s.layers):
        tensors += [(f"blk.{i}.{name}", shape) for name, shape in (
            ("attn_norm.weight", (d,)), ("attn_q.weight", (q, d)), ("attn_q.bias", (q,)),
            ("attn_k.weight", (kv, d)), ("attn_k.bias", (kv,)), ("attn_v.weight", (kv, d)),
            ("attn_v.bias", (kv,)), ("attn_output.weight", (d, q)), ("attn_output.bias", (d,)),
            ("attn_sinks.weight", (s.heads,)), ("post_attention_norm.weight", (d,)),
            ("ffn_gate_inp.weight", (e, d)), ("ffn_gate_inp.bias", (e,)),
            ("ffn_gate_exps.weight", (e, f, d)), ("ffn_gate_exps.bias", (e, f)),
            ("ffn_up_exps.weight", (e, f, d)), ("ffn_up_exps.bias", (e, f)),
            ("ffn_down_exps.weight", (e, d, f)), ("ffn_down_exps.bias", (e, d)))]
    return tensors + [("output_norm.weight", (d,)), ("output.weight", (s.vocab, d))]


def _kind(name: str, shape: tuple[int, ...], others: str) -> str:
    """'mxfp4' (experts), 'f32' (norms, biases, sinks, routers) or `others` ('f16', 'q8_0':
    attention, embedding, output)."""
    if len(shape) == 3:
        return "mxfp4"
    return "f32" if len(shape) == 1 or "ffn_gate_inp" in name or name.endswith(".bias") \
        else others


def mxfp4_bytes(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random MXFP4 blocks for a [..., in] matrix: uint8 [..., in / 32 * 17], each block
    its scale byte then 16 bytes of random nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 17), dtype=np.uint8)
    blocks[..., 0] = MXFP4_SCALE
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * 17)


def q8_0_bytes(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random Q8_0 blocks for a [rows, in] matrix: uint8 [rows, in / 32 * 34], each block
    its f16 scale then 32 random int8 in [-127, 127]."""
    rng = np.random.default_rng(seed)
    blocks = np.empty((*shape[:-1], shape[-1] // 32, 34), np.uint8)
    blocks[..., :2] = np.frombuffer(Q8_0_SCALE.tobytes(), np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, (*shape[:-1], shape[-1] // 32, 32),
                                   dtype=np.int8).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * 34)


def tensor_values(name: str, shape: tuple[int, ...], seed: int, others: str) -> np.ndarray:
    """Norms 1.0; biases, sinks and routers N(0, 0.02) in f32; other matrices N(0, 0.02) in
    f16 or random Q8_0 blocks of that spread; experts random MXFP4 blocks."""
    kind = _kind(name, shape, others)
    if kind == "mxfp4":
        return mxfp4_bytes(shape, seed)
    if kind == "q8_0":
        return q8_0_bytes(shape, seed)
    if kind == "f32" and (len(shape) > 1 or not name.endswith("norm.weight")):
        rng = np.random.default_rng(seed)
        return rng.standard_normal(shape, dtype=np.float32) * 0.02
    return qp.tensor_values(name, shape, qp.LlamaShape(), seed)


def _info(w, name: str, shape: tuple[int, ...], others: str) -> None:
    kind = _kind(name, shape, others)
    if kind in ("mxfp4", "q8_0"):
        qtype, size = (MXFP4, 17) if kind == "mxfp4" else (Q8_0, 34)
        byte_shape = (*shape[:-1], shape[-1] // 32 * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                          raw_dtype=qtype)
        return
    dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
    w.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize)


def write_gpt_oss_gguf(path: Path, vocab_file: Path, s: GptOssShape, others: str) -> None:
    """Stream the model to `path` one tensor at a time, via a .part file."""
    import gguf

    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), ARCH)
    _metadata(w, s)
    qp._copy_tokenizer(w, vocab_file, s.vocab)
    specs = gpt_oss_tensors(s)
    for name, shape in specs:
        _info(w, name, shape, others)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for seed, (name, shape) in enumerate(specs):
        w.write_tensor_data(tensor_values(name, shape, seed, others))
    w.close()
    part.rename(path)


def _metadata(w, s: GptOssShape) -> None:
    w.add_string("general.name", f"gpt-oss-20b-shaped, {s.layers} layers (random weights)")
    w.add_uint32("general.file_type", 38)  # llama.cpp's MOSTLY_MXFP4_MOE
    for key, value in (("block_count", s.layers), ("context_length", s.context),
                       ("embedding_length", s.hidden), ("feed_forward_length", s.expert_ffn),
                       ("expert_feed_forward_length", s.expert_ffn),
                       ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
                       ("attention.key_length", s.head_dim),
                       ("attention.value_length", s.head_dim),
                       ("attention.sliding_window", s.sliding_window),
                       ("vocab_size", s.vocab), ("expert_count", s.experts),
                       ("expert_used_count", s.experts_used),
                       ("rope.scaling.original_context_length", s.yarn_original)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
    w.add_float32(f"{ARCH}.rope.scaling.factor", s.yarn_factor)


def ensure_model(workdir: Path, vocab_file: Path, s: GptOssShape, others: str) -> Path:
    path = workdir / f"gpt-oss-20b-shape-{s.layers}L-MXFP4-{others.upper()}.gguf"
    if path.exists():
        print(f"# have {path}")
        return path
    print(f"# writing {path}", flush=True)
    start = time.perf_counter()
    write_gpt_oss_gguf(path, vocab_file, s, others)
    print(f"#   {path.stat().st_size / 1e9:.1f} GB in {time.perf_counter() - start:.0f} s")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    qp.add_run_args(ap, "MXFP4", "/tmp/kvlab-moe-families")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (gpt-oss-20b: 24)")
    ap.add_argument("--others", choices=("q8_0", "f16"), default="q8_0",
                    help="the type of the matrices outside the experts")
    args = ap.parse_args(argv)
    qp.check_run_args(ap, args, [])
    if args.types != "MXFP4":
        ap.error(f"--types is {args.types!r}: the experts are written as MXFP4 blocks "
                 "directly (valid: MXFP4)")
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engines: list[qp.Engine] = [qp.KvlabBench(), qp.LlamaBench("llama.cpp", args.llama_bin)]
    bandwidth = qp.print_header(engines, args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.workdir, args.vocab, GptOssShape(layers=args.layers),
                         args.others)
    series = qp.bench_file(model, engines, args)
    qp.report(model, series, bandwidth, args,
              moe_peers.moe_step_bytes(model, args.n // 2 + 1, ARCH))


if __name__ == "__main__":
    main()
