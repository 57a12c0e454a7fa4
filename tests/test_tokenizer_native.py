"""The C encoders (kvlab.tokenizer._tok) give the Python reference's ids, token for token.

Each vocabulary is loaded twice, with `native_encoder=True` and `False`, and both encode the
same texts: the other tokenizer tests' corpora, fuzzed text (random code points, literal
tokens and pieces of them, space runs, newlines, long runs without spaces), the empty string
and a text over 1 MB. Vocabularies: the real Gemma 3 one (SentencePiece, 262k tokens), the
tiny hand-made SentencePiece one (many score ties), the byte-level BPEs trained in-process
(Llama 3 with ignore_merges, Qwen 2, GPT-2), and llama.cpp's vocabulary GGUFs (every
pre-tokenizer family it ships, and Gemma 4's BPE over UTF-8) when the environment variable
KVLAB_LLAMA_VOCABS names a folder holding them.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
from test_tokenizer_bpe import EVAL_TEXTS, FAMILIES, TRAIN_TEXT, _train, _write_gguf
from test_tokenizer_gemma import CORPUS, _fuzz_corpus, default_gguf_path
from test_tokenizer_spm import spm_metadata

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import Tokenizer, load_gguf_tokenizer, native
from kvlab.weights.gguf_file import GGUFFile

pytest.importorskip("kvlab.tokenizer._tok", reason="the C tokenizer is not built")

_RANGES = [(0x20, 0x7F), (0xA0, 0x250), (0x300, 0x370), (0x400, 0x500), (0x2580, 0x2590),
           (0x3040, 0x3100), (0x4E00, 0x4F00), (0xAC00, 0xAC80), (0x1F300, 0x1F650),
           (0xE000, 0xE010), (0x10000, 0x10100), (0xE0000, 0xE0080)]
_WORDS = ["hello", " world", "the", "The", "café", "日本語", "don't", "I'M", "12345", "3.14",
          "▁", "▁▁x", "<b>", "def", "    ", "\t", "😀", "e\u0301", "ﬁ", "aaaa", "abc", "Hello"]


def _chunk(rng: random.Random, literals: list[str]) -> str:
    roll = rng.random()
    if roll < 0.3:
        lo, hi = rng.choice(_RANGES)
        return "".join(chr(rng.randrange(lo, hi)) for _ in range(rng.randint(1, 12)))
    if roll < 0.45:
        return " " * rng.randint(1, 40)
    if roll < 0.55:
        return rng.choice(["\n", "\n\n", "\t", "\r\n", " \n ", "\u2581", "\u2581 ", "\n  \n"])
    if roll < 0.67 and literals:
        literal = rng.choice(literals)
        return literal if rng.random() < 0.7 else literal[:rng.randint(1, len(literal))]
    if roll < 0.75:  # a long run without spaces
        return "".join(rng.choice("abcdefghij0123456789") for _ in range(rng.randint(50, 400)))
    return "".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 8)))


def fuzz_texts(n: int, literals: list[str], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(_chunk(rng, literals) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def literal_texts(metadata: dict) -> list[str]:
    """A sample of the vocabulary's control / user-defined / unknown token texts."""
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    literal = [t for t, ty in zip(tokens, types) if ty in (2, 3, 4)]
    return random.Random(1).sample(literal, min(len(literal), 200))


def both(metadata: dict) -> tuple[Tokenizer, Tokenizer]:
    return (load_gguf_tokenizer(metadata, native_encoder=True),
            load_gguf_tokenizer(metadata, native_encoder=False))


def assert_same_ids(native: Tokenizer, python: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        assert native.encode(text, False) == python.encode(text, False), repr(text[:300])


@cache
def gemma_metadata() -> dict:
    return GGUFFile(default_gguf_path()).metadata


@pytest.fixture(scope="module")
def gemma() -> tuple[Tokenizer, Tokenizer]:
    return both(gemma_metadata())


def test_gemma_corpus_and_fuzz(gemma):
    texts = CORPUS + _fuzz_corpus(200) + fuzz_texts(300, literal_texts(gemma_metadata()))
    assert_same_ids(*gemma, ["", " ", "  ", "\n", *texts])


def test_gemma_long_texts(gemma):
    """Space runs (user-defined tokens), a run of one letter, CJK, words after words."""
    rng = random.Random(2)
    words = " ".join(rng.choice(_WORDS) for _ in range(10_000))
    texts = ["hello " * 10_000, "x" + " " * 5000 + "y", "a" * 10_000, "分页注意力把键值缓存" * 1000,
             words, "abcdefghij" * 3000]
    assert_same_ids(*gemma, texts)


@pytest.mark.parametrize("space_prefix", [True, False])
def test_tiny_spm_ties_and_byte_fallback(space_prefix):
    native, python = both(spm_metadata(space_prefix))
    alphabet = ["H", "e", "l", "o", "w", "r", "d", "a", "b", "c", " ", "▁", "€", "<|user|>", "<|u"]
    rng = random.Random(3)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(500)]
    assert_same_ids(native, python, ["", "aaa", "abc", "Hello world", *texts])


def test_over_a_megabyte_of_distinct_words():
    """1 MB of mostly distinct words: far more than the word memo holds before it is emptied."""
    native, python = both(spm_metadata())
    rng = random.Random(4)
    words = ("".join(rng.choice("Helowrdabc") for _ in range(rng.randint(1, 9)))
             for _ in range(200_000))
    text = " ".join(words)[:1_000_000] + "<|user|>" + "a" * 20_000
    assert native.encode(text) == python.encode(text)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def bpe_family(request, tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    pre, regex, ignore_merges, bos = FAMILIES[request.param]
    path = _write_gguf(_train(regex, ignore_merges), pre,
                       tmp_path_factory.mktemp(request.param) / "vocab.gguf", bos)
    return both(GGUFFile(path).metadata)


def test_bpe_corpus_and_fuzz(bpe_family):
    literals = ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<think>"]
    texts = EVAL_TEXTS + TRAIN_TEXT[:9] + fuzz_texts(400, literals, seed=5)
    assert_same_ids(*bpe_family, texts)


def test_bpe_long_text(bpe_family):
    text = "".join(TRAIN_TEXT) * 60 + "hello " * 30_000 + "x" * 20_000
    assert len(text.encode()) > 1_000_000
    assert_same_ids(*bpe_family, [text])


def _llama_cpp_vocabs() -> list[Path]:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    names = ["llama-bpe", "qwen2", "gpt-2", "llama-spm", "phi-3", "command-r", "deepseek-coder",
             "deepseek-llm", "falcon", "gemma-4", "mpt", "qwen35", "refact", "starcoder"]
    paths = [Path(folder) / f"ggml-vocab-{n}.gguf" for n in names] if folder else []
    return [p for p in paths if p.is_file()]


@pytest.mark.skipif(not _llama_cpp_vocabs(),
                    reason="set KVLAB_LLAMA_VOCABS to a folder of llama.cpp's ggml-vocab-*.gguf")
@pytest.mark.parametrize("path", _llama_cpp_vocabs(), ids=lambda p: p.stem)
def test_llama_cpp_vocabularies(path):
    metadata = GGUFFile(path).metadata
    texts = CORPUS + EVAL_TEXTS + fuzz_texts(300, literal_texts(metadata), seed=6)
    assert_same_ids(*both(metadata), texts)


def test_without_the_extension_the_python_reference_encodes(monkeypatch):
    ids = load_gguf_tokenizer(spm_metadata()).encode("Hello world")
    monkeypatch.setattr(native, "AVAILABLE", False)
    tok = load_gguf_tokenizer(spm_metadata())
    assert tok._encode_text.__qualname__.startswith("_fragment_encoder")  # the Python one
    assert tok.encode("Hello world") == ids
    with pytest.raises(ModelLoadError, match="not built"):
        load_gguf_tokenizer(spm_metadata(), native_encoder=True)


def test_text_that_is_not_utf8_encodable_fails_alike(gemma):
    for tok in gemma:
        with pytest.raises(UnicodeEncodeError):
            tok.encode("lone \ud800 surrogate")


def test_threads_encode_at_once_with_the_right_ids(gemma):
    """Calls in parallel take turns with the word memo: one uses it, the others go without."""
    native, python = gemma
    texts = fuzz_texts(40, ["<start_of_turn>", "<end_of_turn>"], seed=7)
    texts = [t * 50 for t in texts]
    expected = [python.encode(t) for t in texts[:8]]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(native.encode, texts[:8])) == expected


def test_encoding_releases_the_gil(gemma):
    """While another thread encodes a long run, this thread keeps running Python."""
    native, _ = gemma
    text = "abcdefghij" * 200_000  # one 2 MB run: long in C, a short list of ids at the end
    done = threading.Event()
    span = {}

    def encode() -> None:
        t0 = time.perf_counter()
        native.encode(text)
        span["s"] = time.perf_counter() - t0
        done.set()

    worker = threading.Thread(target=encode)
    last, longest_pause = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    worker.join()
    assert longest_pause < span["s"] / 3, (longest_pause, span["s"])
