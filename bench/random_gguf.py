"""Random-weight Llama-shaped GGUF files for the GPU benchmarks: F16, or Q4_K_M quantized by
kvlab's own quantizers (kvlab.kernels.quantize, the C least-squares search), written with the
`gguf` package (llama-quantize is not needed where the benchmark runs).

Q4_K_M is llama.cpp's mix: Q4_K everywhere, Q6_K for the output matrix and for attn_v and
ffn_down in the layers llama.cpp gives more bits (the first and last eighth, every third
between). Quantizing all of an 8B model on the CPU would take most of a benchmark's time, so
each matrix kind is quantized once, from SAMPLE_ROWS rows of the given random weights, and
its blocks are tiled to the full row count and reused by every layer: the same bytes per
token and the same block statistics, in a file written in seconds. Weights are random, so
llama.cpp's q/k row interleaving is left out (it only permutes random rows).

The vocabulary is byte-level (printable ASCII, space, newline) then numbered fillers ("<123>")
to the model's size, so a server can take text prompts and any sampled id detokenizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kvlab.kernels import quantize

SAMPLE_ROWS = 512
Q4_K_M_BLOCKS = (T.Q4_K, T.Q6_K)  # both have 256-value blocks


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False  # no output matrix: logits through the embedding (Llama 3.2 1B)
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def tokenizer_metadata(vocab: int) -> dict:
    """A GGUF byte-level BPE vocabulary of `vocab` tokens, no merges; the last is EOS."""
    tokens = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]
    tokens += [f"<{i}>" for i in range(len(tokens), vocab)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * vocab,
            "tokenizer.ggml.merges": ["! !"], "tokenizer.ggml.eos_token_id": vocab - 1,
            "tokenizer.ggml.add_bos_token": False}


def matrix_shapes(s: Shape) -> dict[str, tuple[int, int]]:
    """GGUF matrix name (no layer prefix) -> [rows, cols]."""
    kv = s.kv_heads * s.head_dim
    return {"attn_q": (s.hidden, s.hidden), "attn_k": (kv, s.hidden),
            "attn_v": (kv, s.hidden), "attn_output": (s.hidden, s.hidden),
            "ffn_gate": (s.inter, s.hidden), "ffn_up": (s.inter, s.hidden),
            "ffn_down": (s.hidden, s.inter)}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, layers: int, cols: int) -> T:
    """The type Q4_K_M gives a matrix; Q8_0 where rows do not split into 256-value blocks."""
    if cols % 256:
        return T.Q8_0
    if name == "output" or (name in ("attn_v", "ffn_down") and more_bits(layer, layers)):
        return T.Q6_K
    return T.Q4_K


def tiled_blocks(sample: torch.Tensor, qtype: T, rows: int) -> np.ndarray:
    """sample [r, cols] quantized to qtype, its block rows repeated to `rows`: uint8
    [rows, row bytes]."""
    blocks = quantize(sample.float().cpu().contiguous(), qtype).data.numpy()
    reps = -(-rows // blocks.shape[0])
    return np.ascontiguousarray(np.tile(blocks, (reps, 1))[:rows])


def write(path: Path, s: Shape, matrix: Callable[[str, int], tuple[np.ndarray, T | None]],
          name: str) -> None:
    """A llama GGUF of shape s; matrix(gguf name, layer) -> (data, its quantized type or
    None for a float array). Norms are F32 near 1."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", s.layers), ("context_length", 131072),
                       ("embedding_length", s.hidden), ("feed_forward_length", s.inter),
                       ("attention.head_count", s.heads),
                       ("attention.head_count_kv", s.kv_heads),
                       ("rope.dimension_count", s.head_dim), ("vocab_size", s.vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", s.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", name)
    for key, value in tokenizer_metadata(s.vocab).items():
        _add_key(w, key, value)
    norm = (1 + 0.05 * np.random.default_rng(0).standard_normal(s.hidden)).astype(np.float32)
    _add(w, "token_embd.weight", *matrix("token_embd", 0))
    w.add_tensor("output_norm.weight", norm)
    if not s.tied:
        _add(w, "output.weight", *matrix("output", 0))
    for i in range(s.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        for kind in matrix_shapes(s):
            _add(w, f"blk.{i}.{kind}.weight", *matrix(kind, i))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: T | None) -> None:
    if qtype is None:
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_dtype=qtype)


def _add_key(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        w.add_string(key, str(value))


def write_q4_k_m(path: Path, s: Shape, sample: Callable[[str], torch.Tensor]) -> None:
    """Q4_K_M of shape s; sample(gguf name) -> at least SAMPLE_ROWS rows of that matrix's
    random weights (any dtype and device)."""
    shapes = {**matrix_shapes(s), "token_embd": (s.vocab, s.hidden),
              "output": (s.vocab, s.hidden)}
    done: dict[tuple[str, T], np.ndarray] = {}

    def matrix(kind: str, layer: int) -> tuple[np.ndarray, T]:
        rows, cols = shapes[kind]
        qtype = q4_k_m_type(kind, layer, s.layers, cols)
        if (kind, qtype) not in done:
            done[kind, qtype] = tiled_blocks(sample(kind)[:SAMPLE_ROWS], qtype, rows)
        return done[kind, qtype], qtype

    write(path, s, matrix, "random Llama Q4_K_M")


def write_f16(path: Path, s: Shape, seed: int = 0) -> None:
    """F16 of shape s, N(0, 0.02) weights; each matrix kind drawn once and shared by the
    layers (the file holds every layer's copy; only drawing is saved)."""
    shapes = {**matrix_shapes(s), "token_embd": (s.vocab, s.hidden),
              "output": (s.vocab, s.hidden)}
    gen = torch.Generator().manual_seed(seed)
    drawn: dict[str, np.ndarray] = {}

    def matrix(kind: str, layer: int) -> tuple[np.ndarray, None]:
        if kind not in drawn:
            t = torch.randn(*shapes[kind], generator=gen) * 0.02
            drawn[kind] = t.half().numpy()
        return drawn[kind], None

    write(path, s, matrix, "random Llama F16")
