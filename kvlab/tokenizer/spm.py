"""SentencePiece-style BPE (llama.cpp's "SPM" tokenizer): score-driven merges with byte fallback.

Spaces become U+2581 ("▁"), the text starts as one symbol per character, and the adjacent pair
whose concatenation is a vocabulary piece with the highest score merges first (ties: leftmost).
A heap of candidate pairs over a linked list of symbols keeps this O(n log n). Characters that
never became a piece fall back to `<0xNN>` byte tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

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
        """Merge symbols in place by score; merged-away symbols become ""."""
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            self._push(heap, syms, i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            # Stale entry: one side was merged away or has grown since the pair was pushed.
            if not ls or not rs or len(ls) + len(rs) != size:
                continue
            syms[left], syms[right] = ls + rs, ""
            after = nxt[right]
            nxt[left] = after
            if after != -1:
                prv[after] = left
                self._push(heap, syms, left, after)
            if prv[left] != -1:
                self._push(heap, syms, prv[left], left)
        return [s for s in syms if s]

    def _push(self, heap: list, syms: list[str], left: int, right: int) -> None:
        text = syms[left] + syms[right]
        token_id = self._token_to_id.get(text)
        if token_id is not None:
            # Highest score first; among equal scores the leftmost pair (heap order on `left`).
            heapq.heappush(heap, (-self._scores[token_id], left, right, len(text)))
