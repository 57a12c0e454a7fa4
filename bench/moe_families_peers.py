"""kvlab against llama.cpp on a gpt-oss-20b-shaped mixture-of-experts model, MXFP4 experts.

    .venv/bin/python bench/moe_families_peers.py [-t 2] [-r 3] [-p 512] [-n 128] [--layers 24]
        [--workdir /tmp/kvlab-moe-families] [--llama-bin DIR]

Step, skipped when its output already exists in --workdir: write a random-weight GGUF
(architecture `gpt-oss`) with gpt-oss-20b's shape: 24 layers, hidden 2880, 64 query heads
and 8 KV heads of 64, q/k/v/o biases, a sink logit per head, sliding-window (128) layers by
turns with full ones, YaRN (x32 over 4096), 32 experts of FFN 2880, 4 per token, a biased
router, biased experts with the clamped SwiGLU; the experts as MXFP4 blocks (random nibbles,
one E8M0 scale per 32: the type of OpenAI's release and of llama.cpp's conversion), the
other matrices F16, norms, biases, sinks and routers F32, as llama.cpp's converter keeps
them. The tokenizer is the Llama 3 one from llama.cpp's vocabulary file (128256 tokens where
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


def _kind(name: str, shape: tuple[int, ...]) -> str:
    """'mxfp4' (experts), 'f32' (norms, biases, sinks, routers) or 'f16'."""
    if len(shape) == 3:
        return "mxfp4"
    return "f32" if len(shape) == 1 or "ffn_gate_inp" in name or name.endswith(".bias") \
        else "f16"


def mxfp4_bytes(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random MXFP4 blocks for a [..., in] matrix: uint8 [..., in / 32 * 17], each block
    its scale byte then 16 bytes of random nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 17), dtype=np.uint8)
    blocks[..., 0] = MXFP4_SCALE
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * 17)


def tensor_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Norms 1.0; biases, sinks and routers N(0, 0.02) in f32; other matrices N(0, 0.02) in
    f16; experts random MXFP4 blocks."""
    kind = _kind(name, shape)
    if kind == "mxfp4":
        return mxfp4_bytes(shape, seed)
    if kind == "f32" and (len(shape) > 1 or not name.endswith("norm.weight")):
        rng = np.random.default_rng(seed)
        return rng.standard_normal(shape, dtype=np.float32) * 0.02
    return qp.tensor_values(name, shape, qp.LlamaShape(), seed)


def _info(w, name: str, shape: tuple[int, ...]) -> None:
    kind = _kind(name, shape)
    if kind == "mxfp4":
        byte_shape = (*shape[:-1], shape[-1] // 32 * 17)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                          raw_dtype=MXFP4)
        return
    dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
    w.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize)


def write_gpt_oss_gguf(path: Path, vocab_file: Path, s: GptOssShape) -> None:
    """Stream the model to `path` one tensor at a time, via a .part file."""
    import gguf

    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), ARCH)
    _metadata(w, s)
    qp._copy_tokenizer(w, vocab_file, s.vocab)
    specs = gpt_oss_tensors(s)
    for name, shape in specs:
        _info(w, name, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for seed, (name, shape) in enumerate(specs):
        w.write_tensor_data(tensor_values(name, shape, seed))
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


def ensure_model(workdir: Path, vocab_file: Path, s: GptOssShape) -> Path:
    path = workdir / f"gpt-oss-20b-shape-{s.layers}L-MXFP4.gguf"
    if path.exists():
        print(f"# have {path}")
        return path
    print(f"# writing {path}", flush=True)
    start = time.perf_counter()
    write_gpt_oss_gguf(path, vocab_file, s)
    print(f"#   {path.stat().st_size / 1e9:.1f} GB in {time.perf_counter() - start:.0f} s")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    qp.add_run_args(ap, "MXFP4", "/tmp/kvlab-moe-families")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (gpt-oss-20b: 24)")
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
    model = ensure_model(args.workdir, args.vocab, GptOssShape(layers=args.layers))
    series = qp.bench_file(model, engines, args)
    qp.report(model, series, bandwidth, args,
              moe_peers.moe_step_bytes(model, args.n // 2 + 1, ARCH))


if __name__ == "__main__":
    main()
