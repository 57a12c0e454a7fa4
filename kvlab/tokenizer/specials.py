"""Finding special and user-defined tokens written literally in text.

Control tokens (`<start_of_turn>`, `<|im_start|>`) and user-defined tokens (Gemma's `\\n` and
space runs, `<think>`) are cut out of the raw text before the subword model sees it, the way
llama.cpp and Hugging Face `tokenizers` both do. Matching is leftmost-longest over a character
trie, so a 6k-token special vocabulary costs one dict walk per candidate position. Some
models' literal tokens swallow the ASCII whitespace before (lstrip) or after (rstrip) them,
as llama.cpp strips it (C's isspace).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_END = ""  # trie key marking "a token ends here"; never a real character
_C_SPACE = " \t\n\v\f\r"

Piece = str | int  # a run of ordinary text, or the id of a literal token


class SpecialSplitter:
    """Cuts text into ordinary runs and literal-token ids, leftmost-longest."""

    def __init__(self, tokens: Iterable[tuple[str, int]], lstrip: Iterable[int] = (),
                 rstrip: Iterable[int] = ()) -> None:
        self._lstrip, self._rstrip = frozenset(lstrip), frozenset(rstrip)
        self._trie: dict = {}
        for text, token_id in tokens:
            if text:
                self._insert(text, token_id)
        first_chars = "".join(sorted(k for k in self._trie))
        self._candidates = re.compile("[" + re.escape(first_chars) + "]") if first_chars else None

    def _insert(self, text: str, token_id: int) -> None:
        node = self._trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[_END] = token_id  # a text listed twice keeps its last id, like the vocab map

    def _longest_at(self, text: str, pos: int) -> tuple[int, int] | None:
        """(end, id) of the longest literal token starting at `pos`, if any."""
        node, best, i = self._trie, None, pos
        while i < len(text):
            node = node.get(text[i])
            if node is None:
                break
            i += 1
            if _END in node:
                best = (i, node[_END])
        return best

    def split(self, text: str) -> list[Piece]:
        """Ordinary text runs (str) interleaved with literal-token ids (int), in order."""
        if self._candidates is None:
            return [text] if text else []
        pieces: list[Piece] = []
        start = pos = 0
        while True:
            m = self._candidates.search(text, pos)
            if m is None:
                break
            pos = m.start()
            hit = self._longest_at(text, pos)
            if hit is None:
                pos += 1
                continue
            left = text[start:pos]
            if hit[1] in self._lstrip:
                left = left.rstrip(_C_SPACE)
            if left:
                pieces.append(left)
            pieces.append(hit[1])
            start = pos = hit[0]
            if hit[1] in self._rstrip:
                while start < len(text) and text[start] in _C_SPACE:
                    start = pos = start + 1
        if start < len(text):
            pieces.append(text[start:])
        return pieces
