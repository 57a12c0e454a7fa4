"""Unigram (GGUF `tokenizer.ggml.model` = "t5") tokenizers: a hand-built vocabulary whose
Viterbi paths are worked out below, and XLM-RoBERTa's real vocabulary against ids recorded
from llama.cpp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGUFWriter

from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

# id: token, score, type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused)
TOY = [("<pad>", 0.0, 3), ("</s>", 0.0, 3), ("<unk>", 0.0, 2), ("▁", -2.0, 1),
       ("▁a", -1.0, 1), ("b", -2.0, 1), ("▁ab", -2.5, 1), ("a", -3.0, 1), ("c", -4.0, 1),
       ("<sep>", 0.0, 4), ("[PAD9]", -10000.0, 5)]


def _write_toy(path: Path, **switches: bool) -> Path:
    """The toy vocabulary; whitespace switches as T5's and XLM-R's files set them unless
    given."""
    switches = {"add_space_prefix": True, "remove_extra_whitespaces": True, **switches}
    writer = GGUFWriter(str(path), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list([t for t, _, _ in TOY])
    writer.add_token_scores([s for _, s, _ in TOY])
    writer.add_token_types([ty for _, _, ty in TOY])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 2)
    for key, value in switches.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = _write_toy(tmp_path_factory.mktemp("ugm") / "toy.gguf")
    return load_gguf_tokenizer(GGUFFile(str(path)).metadata)


@pytest.mark.parametrize(("text", "ids"), [
    ("ab", [6]),                 # "▁ab" -2.5 beats "▁a"+"b" -3.0 and "▁"+"a"+"b" -7.0
    ("a b", [4, 3, 5]),          # "▁a▁b": "▁a" + "▁" + "b" = -5.0
    ("  a   b  ", [4, 3, 5]),    # extra whitespace removed, as llama.cpp does by default
    ("aa", [4, 7]),              # "▁a" + "a"
    ("a xy", [4, 3, 2]),         # unknown "x", "y" fuse into one <unk> (score -4 - 10 each)
    ("a<sep>b", [4, 9, 3, 5]),   # user-defined tokens are literal; each run gains its "▁"
    ("a</s>c", [4, 1, 3, 8]),    # so are control tokens
    ("[PAD9]", [3, 2]),          # out of reach at -10000: "▁", then one fused <unk>
    ("", []),
    ("   ", []),
])
def test_toy_vocabulary_viterbi(toy, text, ids):
    assert toy.encode(text, add_special_tokens=False) == ids


def test_toy_appends_eos_and_decodes(toy):
    ids = toy.encode("ab c")
    assert ids == [6, 3, 8, 1]  # llama.cpp's t5 default: no BOS, EOS appended
    assert toy.decode(ids) == "ab c"


@pytest.mark.parametrize(("switches", "ids"), [
    ({"remove_extra_whitespaces": False}, [3, 4, 3, 3, 5]),  # "▁▁a▁▁b": every space kept
    ({"remove_extra_whitespaces": False, "add_space_prefix": False}, [4, 3, 3, 5]),
    ({"add_space_prefix": False}, [4, 3, 5]),  # merging spaces puts one before every word
])
def test_whitespace_switches(tmp_path, switches, ids):
    path = _write_toy(tmp_path / "spaces.gguf", **switches)
    tok = load_gguf_tokenizer(GGUFFile(str(path)).metadata)
    assert tok.encode(" a  b", add_special_tokens=False) == ids


def _nomic() -> Path | None:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    path = Path(folder or ".") / "ggml-vocab-nomic-bert-moe.gguf"
    return path if folder and path.exists() else None


# llama.cpp's output (llama-tokenize --ids --no-bos) for XLM-RoBERTa's vocabulary
NOMIC_CASES = [
    ("hello <mask> world", [33600, 31, 250001, 8999]),
    ("a🌫Ω\ufe0f①a㌔", [10, 3, 20723, 15755, 418, 11, 189402]),
    ("   leading", [105207]),
    ("a    b", [10, 876]),
    ("\t\ttabs\n\nnewlines", [20928, 7, 3525, 59801]),
    ("ＡＢＣ fullwidth ½ ﬁ ligature", [47457, 4393, 146984, 78660, 809, 19881, 6644]),
    ("中文 测试 日本語のテキスト 한국어", [6, 32095, 6, 49125, 6, 98449, 154, 193508, 193751]),
    ("😀 emoji 👍🏽 family 👨\u200d👩\u200d👧",
     [21119, 28, 121505, 6, 118280, 245164, 14449, 6, 244314, 6, 244785, 6, 245719]),
    ("[PAD250001] x", [378, 116908, 2588, 188735, 268, 1022]),
    ("\u200bzero width", [45234, 6, 146984]),
    ("café café", [26216, 26216]),
    ("   ", []),
    # the charsmap's longest match: decomposed Hangul, Bengali and Tamil vowels, accents
    ("\u1100\u1161\u11a8", [27716]),
    ("\u0995\u09c7\u09be", [60546]),
    ("\u0b95\u0bc6\u0bbe", [31391]),
    ("e\u0323\u0302", [6, 21018]),
    ("\U0001d400\u0301", [3566]),
    # an <unk> early in the text must not blur the scores of the pieces after it
    (("🚀 (normal) 😶\u200d🌫\ufe0f (multiple emojis concatenated) ✅ (only emoji that has its "
      "own token)"), [6, 247206, 15, 33176, 16, 6, 247442, 6, 3, 15755, 15, 144227, 8705, 18255,
                    40292, 158, 4460, 33, 27686, 16, 6, 142325, 15, 191, 538, 28, 121505, 450,
                    1556, 6863, 10002, 47, 1098, 16]),
]


@pytest.mark.skipif(_nomic() is None, reason="set KVLAB_LLAMA_VOCABS (nomic-bert-moe vocabulary)")
def test_xlm_roberta_vocabulary_matches_llama_cpp():
    tok = load_gguf_tokenizer(GGUFFile(str(_nomic())).metadata)
    for text, ids in NOMIC_CASES:
        assert tok.encode(text, add_special_tokens=False) == ids, text
    assert tok.encode("Hello world") == [0, 35378, 8999, 2]  # <s> ... </s>, as the file asks
