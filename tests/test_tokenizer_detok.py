"""IncrementalDetokenizer: streamed deltas concatenate to decode(all), never with U+FFFD mid-stream."""

from __future__ import annotations

import pytest
from test_tokenizer_bpe import QWEN2_REGEX, _train, _write_gguf
from test_tokenizer_gemma import default_tokenizer
from test_tokenizer_spm import spm_metadata

from kvlab.tokenizer import IncrementalDetokenizer, load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

TEXTS = [
    "Hello world", "日本語のテキストを分割します。", "😀 emoji 🎉 mixed 👨‍👩‍👧 in text 🏳️‍🌈",
    "中文 and English 123", "Ünïcödé façade", "\U0001d54f\U000e0041 rare characters",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "  spaces  \n\n newlines",
]


def stream(tok, ids, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.fixture(scope="module")
def gemma():
    return default_tokenizer()


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    path = _write_gguf(_train(QWEN2_REGEX, False), "qwen2",
                       tmp_path_factory.mktemp("bpe") / "v.gguf", None)
    return load_gguf_tokenizer(GGUFFile(path).metadata)


@pytest.mark.parametrize("name", ["gemma", "byte_level"])
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_decode(request, name, skip):
    tok = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), text
        assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_multibyte_character_is_held_back(byte_level):
    """An emoji the small vocabulary spells as several byte tokens appears only when complete."""
    ids = byte_level.encode("🦜", add_special_tokens=False)
    assert len(ids) > 1
    deltas = stream(byte_level, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🦜"


def test_byte_fallback_is_held_back(gemma):
    ids = gemma.encode("\U000e0041", add_special_tokens=False)  # four <0xNN> tokens
    assert stream(gemma, ids) == ["", "", "", "\U000e0041", ""]


def test_incomplete_tail_is_flushed_as_replacement(gemma):
    ids = gemma.encode("\U000e0041", add_special_tokens=False)[:2]
    detok = IncrementalDetokenizer(gemma)
    assert [detok.push(i) for i in ids] == ["", ""]
    assert detok.flush() == "\ufffd"


def test_first_token_loses_its_sentencepiece_space_prefix():
    tok = load_gguf_tokenizer(spm_metadata(add_space_prefix=True))
    ids = tok.encode("Hello world")
    assert stream(tok, ids) == ["", "Hello", " world", ""]


def test_special_tokens_skipped_or_shown(gemma):
    ids = gemma.encode("<start_of_turn>model\nok<end_of_turn>")
    assert "".join(stream(gemma, ids)) == "model\nok"
    shown = "".join(stream(gemma, ids, skip_special_tokens=False))
    assert shown == "<bos><start_of_turn>model\nok<end_of_turn>"
