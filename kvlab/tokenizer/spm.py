"""SentencePiece-style BPE (llama.cpp's "SPM" tokenizer): score-driven merges with byte fallback.

Spaces become U+2581 ("▁"), the text starts as one symbol per character, and the adjacent pair
whose concatenation is a vocabulary piece with the highest score merges first (ties: leftmost).
A heap of candidate pairs over a linked list of symbols keeps this O(n log n). Characters that
never became a piece fall back to `<0xNN>` byte tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.tokenizer.merge import merge_symbols

SPACE_MARK = "\u2581"  # SentencePiece's visible space


class SentencePieceBPE:
    """Encodes ordinary text (no special tokens) with score-ordered merges."""

    def __init__(self, token_to_id: dict[str, int], scores: Sequence[float],
                 byte_ids: Sequence[int | None], unk_id: int | None) -> None:
        self._token_to_id = token_to_id
        self._scores = scores
        self._byte_ids = byte_ids  # byte value -> id of its <0xNN> token
        self._unk_id = unk_id

    def encode(self, text: str) -> list[int]:
        """Ids for `text`; spaces are escaped to U+2581 here."""
        if not text:
            return []
        pieces = self._merge(list(text.replace(" ", SPACE_MARK)))
        ids: list[int] = []
        for piece in pieces:
            token_id = self._token_to_id.get(piece)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._byte_fallback(piece))
        return ids

    def _byte_fallback(self, piece: str) -> list[int]:
        ids = [self._byte_ids[b] for b in piece.encode("utf-8")]
        if None in ids:  # a vocabulary without byte tokens: one <unk> for the piece
            return [] if self._unk_id is None else [self._unk_id]
        return ids  # type: ignore[return-value]

    def _merge(self, syms: list[str]) -> list[str]:
        """Merge symbols by score: the highest-scoring vocabulary piece first."""
        return merge_symbols(syms, self._priority)

    def _priority(self, left: str, right: str) -> float | None:
        token_id = self._token_to_id.get(left + right)
        return None if token_id is None else -self._scores[token_id]

