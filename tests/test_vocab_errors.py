"""A GGUF whose vocabulary is corrupt fails to load with a kvlab error naming the key.

Each file is written with the `gguf` package's writer: a small byte-level BPE or
SentencePiece vocabulary that loads, then one thing broken in it (lists of different lengths,
a special token's id outside the vocabulary, the merges of a BPE vocabulary missing or
malformed, a token type that is no type). Loading it through `GGUFFile` and
`load_gguf_tokenizer`, as the engine does, raises `ModelLoadError` whose message names the
metadata key, never an IndexError or a tokenizer that fails later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")

BPE_TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "ab", "<|end|>"]
SPM_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"]
BERT_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\u2581ab", "b"]


def bpe(**changes: Any) -> dict[str, Any]:
    """A byte-level BPE vocabulary that loads; `changes` replace (None: drop) its keys."""
    n = len(BPE_TOKENS)
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": BPE_TOKENS, "tokenizer.ggml.token_type": [1] * (n - 1) + [3],
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": n - 1,
        "tokenizer.ggml.bos_token_id": n - 1}
    return _changed(keys, changes)


def spm(**changes: Any) -> dict[str, Any]:
    """A SentencePiece vocabulary that loads; `changes` replace (None: drop) its keys."""
    n = len(SPM_TOKENS)
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": SPM_TOKENS,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -2.5],
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (n - 3),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0}
    return _changed(keys, changes)


def bert(**changes: Any) -> dict[str, Any]:
    """A WordPiece vocabulary that loads; `changes` replace (None: drop) its keys."""
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": BERT_TOKENS,
        "tokenizer.ggml.token_type": [3, 1, 3, 3, 1, 1],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.seperator_token_id": 3,
        "tokenizer.ggml.unknown_token_id": 1, "tokenizer.ggml.padding_token_id": 0}
    return _changed(keys, changes)


def _changed(keys: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    for name, value in changes.items():
        key = "tokenizer.ggml." + name
        if value is None:
            keys.pop(key, None)
        else:
            keys[key] = value
    return keys


def write(path: Path, keys: dict[str, Any]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(tmp_path: Path, keys: dict[str, Any], native: bool | None = None):
    return load_gguf_tokenizer(GGUFFile(write(tmp_path / "vocab.gguf", keys)).metadata, native)


@pytest.mark.parametrize("keys", [bpe(), spm(), bert()], ids=["bpe", "spm", "bert"])
def test_the_sound_vocabularies_load(tmp_path: Path, keys: dict[str, Any]) -> None:
    tok = load(tmp_path, keys)
    assert tok.decode(tok.encode("ab", add_special_tokens=False)) == "ab"


CORRUPT = {
    "scores shorter": (spm(scores=[0.0] * 5), "tokenizer.ggml.scores"),
    "scores longer": (spm(scores=[0.0] * 12), "tokenizer.ggml.scores"),
    "token types too short": (bpe(token_type=[1] * 10), "tokenizer.ggml.token_type"),
    "token types too long (spm)": (spm(token_type=[1] * 9), "tokenizer.ggml.token_type"),
    "a token type that is none": (bpe(token_type=[1] * (len(BPE_TOKENS) - 1) + [9]),
                                  "tokenizer.ggml.token_type"),
    "eos out of range": (bpe(eos_token_id=len(BPE_TOKENS)), "tokenizer.ggml.eos_token_id"),
    "bos out of range": (spm(bos_token_id=99), "tokenizer.ggml.bos_token_id"),
    "bert separator out of range": (bert(seperator_token_id=6),
                                    "tokenizer.ggml.seperator_token_id"),
    "bert token types too short": (bert(token_type=[3, 3]), "tokenizer.ggml.token_type"),
    "unknown out of range": (spm(unknown_token_id=8), "tokenizer.ggml.unknown_token_id"),
    "eot out of range": (bpe(eot_token_id=500), "tokenizer.ggml.eot_token_id"),
    "bpe merges missing": (bpe(merges=None), "tokenizer.ggml.merges"),
    "no tokens": (bpe(tokens=None, token_type=None, eos_token_id=None, bos_token_id=None),
                  "tokenizer.ggml.tokens"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
@pytest.mark.parametrize("native", [None, False], ids=["default", "python"])
def test_a_corrupt_vocabulary_fails_at_load_naming_the_key(tmp_path: Path, case: str,
                                                           native: bool | None) -> None:
    keys, key = CORRUPT[case]
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")) as caught:
        load(tmp_path, keys, native)
    assert "GGUF" in str(caught.value)


def test_ids_kvlab_never_reads_may_lie_outside_as_llama_cpp_allows(tmp_path: Path) -> None:
    """A padding or mask id past the vocabulary (real files carry them; llama.cpp warns and
    drops them) is only absent: the vocabulary loads and encodes."""
    tok = load(tmp_path, spm(padding_token_id=1000, mask_token_id=99))
    assert tok.decode(tok.encode("ab", add_special_tokens=False)) == "ab"
