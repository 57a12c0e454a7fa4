"""WordPiece tokenizers (BERT): `[CLS] text [SEP]` (bos_id and suffix_id of the Tokenizer),
encoded by the `tokenizers` library.

The library's WordPiece model, BERT normalizer and pre-tokenizer are the reference for this
scheme, so nothing is written by hand: an HF directory's tokenizer.json is used as it is, and
a GGUF vocabulary (`tokenizer.ggml.model` = "bert") is turned back into one. llama.cpp's
converter respells that vocabulary with a "phantom space": a word-initial token gains a
U+2581 prefix, a continuation loses its "##", control tokens stay as they are; undoing that
gives the WordPiece vocabulary. llama.cpp's WordPiece lowercases its input (uncased BERT),
so the GGUF tokenizer does too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, models, normalizers, pre_tokenizers

from kvlab.errors import ModelLoadError
from kvlab.tokenizer.spm import SPACE_MARK
from kvlab.tokenizer.tokenizer import Tokenizer

CONTROL = 3  # tokenizer.ggml.token_type of [CLS], [SEP], [PAD], [MASK]
_SPECIAL_TYPES = (2, 3, 5)  # unknown, control, unused: hidden when decoding skips specials


def wordpiece_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """From llama.cpp's `bert` vocabulary: tokens, token types and the special ids."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens vocabulary")
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    words = [_unphantom(t, ty) for t, ty in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, word in enumerate(words):
        vocab.setdefault(word, i)
    unk = _token(metadata, "unknown", tokens, "[UNK]")
    hf = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk or "[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types)
                           if ty == CONTROL])
    cls_id = _id(metadata, "bos", tokens, "[CLS]")
    sep_id = metadata.get("tokenizer.ggml.seperator_token_id", _id(metadata, "eos", tokens,
                                                                   "[SEP]"))
    wrap = bool(metadata.get("tokenizer.ggml.add_sep_token",
                             metadata.get("tokenizer.ggml.add_eos_token", True)))
    return _build(hf, [_piece(w, ty) for w, ty in zip(words, types)],
                  [ty in _SPECIAL_TYPES for ty in types], cls_id,
                  sep_id if wrap else None,
                  bool(metadata.get("tokenizer.ggml.add_bos_token", True)))


def wordpiece_from_hf(hf: tokenizers.Tokenizer) -> Tokenizer:
    """From a tokenizer.json whose model is WordPiece; the special tokens its
    post-processor puts around a text are the ones encode adds."""
    vocab = hf.get_vocab(with_added_tokens=True)
    added = hf.get_added_tokens_decoder()
    pieces, special = [b""] * (max(vocab.values()) + 1), [False] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        pieces[i] = _piece(text, CONTROL if i in added else 1)
        special[i] = i in added and bool(added[i].special)
    wrap = hf.encode("", add_special_tokens=True).ids
    cls_id = wrap[0] if wrap else None
    sep_id = wrap[-1] if len(wrap) > 1 else None
    return _build(hf, pieces, special, cls_id, sep_id, cls_id is not None)


def _build(hf: tokenizers.Tokenizer, pieces: list[bytes], special: list[bool],
           cls_id: int | None, sep_id: int | None, add_cls: bool) -> Tokenizer:
    def encode_text(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return Tokenizer(
        encode_text=encode_text, pieces=pieces, special=special, bos_id=cls_id,
        eos_ids=[sep_id] if sep_id is not None else [], add_bos=add_cls and cls_id is not None,
        chat_template=None, strip_leading_space=True, suffix_id=sep_id)


def _unphantom(token: str, token_type: int) -> str:
    """llama.cpp's spelling of a token -> WordPiece's ("▁word" -> "word", "ing" -> "##ing")."""
    if token.startswith(SPACE_MARK):
        return token[len(SPACE_MARK):]
    return token if token_type == CONTROL else "##" + token


def _piece(word: str, token_type: int) -> bytes:
    """The bytes a token decodes to: a word starts with a space, a continuation does not."""
    if token_type == CONTROL:
        return word.encode("utf-8")
    return word[2:].encode("utf-8") if word.startswith("##") else b" " + word.encode("utf-8")


def _id(metadata: dict[str, Any], name: str, tokens: list[str], default: str) -> int | None:
    found = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if found is None and default in tokens:
        return tokens.index(default)
    return found


def _token(metadata: dict[str, Any], name: str, tokens: list[str], default: str) -> str | None:
    i = _id(metadata, name, tokens, default)
    return _unphantom(tokens[i], CONTROL) if i is not None and 0 <= i < len(tokens) else None
