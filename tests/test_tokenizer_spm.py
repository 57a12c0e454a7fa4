"""SentencePiece-style BPE rules on a tiny hand-made GGUF vocabulary.

What the real Gemma vocabulary cannot show: score order and leftmost ties, the llama.cpp space
prefix (first run and after every literal token) and its removal when decoding, byte fallback,
and the errors for vocabularies kvlab cannot run.
"""

from __future__ import annotations

import pytest

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import load_gguf_tokenizer

PIECES = {  # piece -> score (higher merges first)
    "▁": -1.0, "H": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
    "a": -2.0, "b": -2.0, "c": -2.0, "ll": -1.5, "▁H": -1.4, "▁He": -1.3, "llo": -1.2,
    "▁Hello": -1.0, "▁w": -1.4, "or": -1.5, "▁wor": -1.2, "ld": -1.6, "▁world": -0.9,
    "aa": -1.0, "ab": -3.0, "bc": -2.5,
}
CONTROL = ["<|user|>"]


def spm_metadata(add_space_prefix: bool = True) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *CONTROL] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3, *[3] * len(CONTROL)] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, score in PIECES.items():
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    return {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(spm_metadata())


def pieces(tok, ids: list[int]) -> list[str]:
    return [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]


def test_space_prefix_and_merges(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_id
    assert pieces(tok, ids[1:]) == [" Hello", " world"]
    assert tok.decode(ids) == "Hello world"  # the prefix space is dropped again


def test_space_prefix_follows_each_literal_token(tok):
    """llama.cpp prefixes " " to a text run at the start and after every literal token."""
    ids = tok.encode("<|user|>Hello", add_special_tokens=False)
    assert pieces(tok, ids) == ["<|user|>", " Hello"]
    assert tok.decode(ids) == "Hello"


def test_higher_score_merges_first():
    """"abc": "bc" (-2.5) outscores "ab" (-3.0), so the result is a + bc."""
    tok = load_gguf_tokenizer(spm_metadata(add_space_prefix=False))
    assert pieces(tok, tok.encode("abc", add_special_tokens=False)) == ["a", "bc"]


def test_equal_scores_merge_leftmost_first():
    tok = load_gguf_tokenizer(spm_metadata(add_space_prefix=False))
    assert pieces(tok, tok.encode("aaa", add_special_tokens=False)) == ["aa", "a"]


def test_byte_fallback(tok):
    ids = tok.encode("€", add_special_tokens=False)  # "▁" then the three UTF-8 bytes of €
    assert [tok.token_bytes(i) for i in ids] == [b" ", b"\xe2", b"\x82", b"\xac"]
    assert tok.decode(ids) == "€"


def test_no_space_prefix_when_the_vocabulary_says_so():
    tok = load_gguf_tokenizer(spm_metadata(add_space_prefix=False))
    ids = tok.encode("Hello", add_special_tokens=False)
    assert pieces(tok, ids) == ["H", "e", "llo"]
    assert tok.decode(ids) == "Hello"


def test_unsupported_tokenizer_model_says_what_is_supported():
    meta = dict(spm_metadata(), **{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelLoadError, match=r"'rwkv'.*supported: llama .*gpt2"):
        load_gguf_tokenizer(meta)


def test_missing_scores_is_a_load_error():
    meta = spm_metadata()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelLoadError, match="scores"):
        load_gguf_tokenizer(meta)


def test_ids_beyond_the_vocabulary_decode_to_nothing(tok):
    """A model's embedding may have padded rows past the tokenizer's last id."""
    ids = [tok.vocab_size + 5, *tok.encode("Hello", add_special_tokens=False), -1]
    assert tok.decode(ids) == "Hello"
    assert tok.token_bytes(tok.vocab_size) == b"" and not tok.is_special(-1)


def test_inconsistent_metadata_is_a_load_error():
    meta = spm_metadata()
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:-1]
    with pytest.raises(ModelLoadError, match="token_type has .* entries"):
        load_gguf_tokenizer(meta)
