"""Streaming detokenization: token ids in, final text deltas out.

Bytes accumulate in an incremental UTF-8 decoder, so a character split across tokens (emoji,
CJK, byte-fallback pieces) is held back until complete instead of printing as U+FFFD; the
deltas concatenate to exactly `Tokenizer.decode(all ids)`.

Most tokens' bytes are whole characters: once a detokenizer holds no partial character
and is past its first token (`settled`), such a token's delta is its own text, the same
for every request. `TokenTexts` keeps those texts, so that a caller streaming many
requests can skip the decoder for them.
"""

from __future__ import annotations

import codecs

from kvlab.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one request's generated ids into text as they arrive."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 shown: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._shown = shown  # special tokens written even when specials are skipped
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True  # the first emitted token may lose its SentencePiece space prefix

    def push(self, token_id: int) -> str:
        """Text that is now final after `token_id` (may be "" while a character is incomplete)."""
        if self._skip_special and self._tokenizer.is_special(token_id) \
                and token_id not in self._shown:
            return ""
        piece = self._tokenizer.token_bytes(token_id)
        if not piece:  # e.g. an id beyond the vocabulary; decode() skips these too
            return ""
        if self._first:
            self._first = False
            if self._tokenizer.strip_leading_space and piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    @property
    def settled(self) -> bool:
        """Past the first token and holding no partial character: a token's delta is then
        its TokenTexts text, where it has one."""
        return not self._first and not self._utf8.getstate()[0]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class TokenTexts:
    """Token id -> the text it adds to a settled detokenizer's stream: its bytes decoded,
    where they are whole UTF-8 characters and it is not a special token; "" for the others
    (their delta depends on what came before, or on the request). Filled as tokens are met:
    `known` holds the ids looked up so far."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self.known.get(token_id)
        if text is None:
            text = self.known[token_id] = self._own(token_id)
        return text

    def _own(self, token_id: int) -> str:
        if self._tokenizer.is_special(token_id):
            return ""
        try:
            return self._tokenizer.token_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:  # part of a character: the decoder holds it back
            return ""
