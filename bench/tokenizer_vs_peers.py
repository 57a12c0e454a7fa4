"""kvlab's tokenizer beside `tokenizers` (Hugging Face, Rust) and llama.cpp's `llama-tokenize`
on the same vocabulary: encode speed on ~1 MB of mixed prose, code and CJK text that does not
repeat itself (so no encoder gains from seeing a paragraph twice), and whether the ids agree.

    .venv/bin/python bench/tokenizer_vs_peers.py DIR --llama-tokenize PATH \\
        --vocabs qwen2 llama-bpe gemma-4 -r 3

DIR holds llama.cpp's ggml-vocab-<name>.gguf files (`make llama-files` fetches them to
.cache/llama_cpp_python-0.3.36/models). `tokenizers` gets the vocabulary through
transformers' GGUF conversion; a vocabulary it cannot convert is reported, not timed.
llama-tokenize's time is its run on the text less its run on one line (loading the
vocabulary is not counted); every time is the best of the rounds, in each of which the
encoders take turns.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
import time
from pathlib import Path

from kvlab.tokenizer.from_gguf import load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

REPO = Path(__file__).resolve().parents[1]
SMALL_TEXT = "The scheduler decides, at every step, which requests run."


def text_of(size: int) -> str:
    """~`size` bytes that do not repeat: 40% prose (the Markdown under the repository and its
    virtual environment), 40% code (kvlab's own sources), 20% CJK (seeded random sentences of
    common ideographs and kana), interleaved in 4 KB pieces."""
    def read(paths: list[Path], limit: int) -> str:
        out, n = [], 0
        for path in sorted(paths):
            text = path.read_text(encoding="utf-8", errors="ignore")
            out.append(text)
            n += len(text.encode())
            if n >= limit:
                break
        return "".join(out)[:limit]

    prose = read([*REPO.glob("*.md"), *REPO.glob("docs/*.md"),
                  *REPO.glob(".venv/lib/python3*/site-packages/**/*.md")], size * 2 // 5)
    code = read(list(REPO.glob("kvlab/**/*.py")), size * 2 // 5)
    rng = random.Random(0)
    cjk = "".join(rng.choice(CJK) if rng.random() > 0.06 else rng.choice("，。！？、")
                  for _ in range(size // 5 // 3))
    parts = [prose, code, cjk]
    pieces = [p[i:i + 4096] for i in range(0, max(map(len, parts)), 4096) for p in parts]
    return "".join(pieces)


CJK = ([chr(c) for c in range(0x4E00, 0x4E00 + 3000)] + [chr(c) for c in range(0x3041, 0x3097)]
       + [chr(c) for c in range(0x30A1, 0x30FB)])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_tokenizer(path: Path):
    """The vocabulary as a `tokenizers` object, through transformers' GGUF conversion."""
    from transformers import AutoTokenizer

    try:
        auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return auto.backend_tokenizer
    except Exception as e:  # noqa: BLE001 - any conversion failure is reported, not timed
        print(f"  tokenizers: cannot convert {path.name}: {type(e).__name__}: {str(e)[:80]}")
        return None


def llama_run(binary: str, model: Path, text_file: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([binary, "-m", str(model), "-f", str(text_file), "--ids", "--log-disable",
                    "--no-bos"], capture_output=True, check=True)
    return time.perf_counter() - t0


def measure(path: Path, text: str, files: tuple[Path, Path], binary: str | None,
            rounds: int) -> tuple[dict[str, float], list[str], int]:
    """(best seconds per encoder, id agreement notes, kvlab's token count); the encoders take
    turns within each round. kvlab's tokenizer is loaded afresh (untimed) for each round, so
    its word memo starts empty: no round gains from having seen the text before."""
    metadata = GGUFFile(path).metadata
    ids = load_gguf_tokenizer(metadata).encode(text, add_special_tokens=False)
    hf = hf_tokenizer(path)

    def kvlab_run() -> float:
        kv = load_gguf_tokenizer(metadata)
        return timed(lambda: kv.encode(text, add_special_tokens=False))

    runs = {"kvlab": kvlab_run}
    notes = []
    if hf is not None:
        runs["tokenizers"] = lambda: timed(lambda: hf.encode(text, add_special_tokens=False))
        same = hf.encode(text, add_special_tokens=False).ids == ids
        notes.append(f"tokenizers ids {'agree' if same else 'differ'}")
    if binary is not None:
        big, small = files
        runs["llama-tokenize"] = lambda: (llama_run(binary, path, big)
                                          - llama_run(binary, path, small))
    seconds = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds[name] = min(seconds[name], max(run(), 1e-9))
    return seconds, notes, len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--llama-tokenize", default=None)
    p.add_argument("--vocabs", nargs="+", default=["qwen2", "llama-bpe", "gemma-4"])
    p.add_argument("--size", type=int, default=1 << 20, help="bytes of text")
    p.add_argument("-r", "--rounds", type=int, default=3)
    args = p.parse_args()
    text = text_of(args.size)
    mb = len(text.encode()) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.txt", Path(tmp) / "small.txt"
        big.write_text(text)
        small.write_text(SMALL_TEXT)
        for name in args.vocabs:
            path = args.folder / f"ggml-vocab-{name}.gguf"
            seconds, notes, n = measure(path, text, (big, small), args.llama_tokenize,
                                        args.rounds)
            rates = {k: mb / v for k, v in seconds.items()}
            peers = [v for k, v in rates.items() if k != "kvlab"]
            line = ", ".join(f"{k} {v:.1f} MB/s" for k, v in rates.items())
            ratio = f"; kvlab / fastest peer {rates['kvlab'] / max(peers):.2f}x" if peers else ""
            print(f"{name}: {n} tokens in {mb:.2f} MB: {line}{ratio}"
                  f"{'; ' + '; '.join(notes) if notes else ''}", flush=True)


if __name__ == "__main__":
    main()
