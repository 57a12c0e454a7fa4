"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (prompt and output so far), longest n first. No second model.

The index is built incrementally, so a proposal costs a few dict lookups (microseconds)
whatever the context length. An n-gram is entered once the token after it is known, keyed
to that token's position, so the sequence's own suffix is never its own match:

    tokens:   a b c d a b c   ?          suffix "a b c" (n = 3)
    index:    (a b c) -> 3               entered when d arrived
    proposal: tokens[3:3 + k] = d a b c  (shorter where the sequence ends)
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4  # longest suffix looked up
MIN_NGRAM = 1  # shortest suffix looked up


class NgramIndex:
    """One sequence's n-gram -> position of the token that followed its latest occurrence."""

    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got "
                             f"{min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.follows: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens of the sequence seen so far

    def extend(self, token_ids: Sequence[int]) -> None:
        """Take in the tokens past those already seen (token_ids only ever grows here)."""
        follows, lo, hi = self.follows, self.min_n, self.max_n
        for j in range(max(self.num_indexed, 1), len(token_ids)):
            for n in range(lo, min(hi, j) + 1):
                follows[tuple(token_ids[j - n:j])] = j
        self.num_indexed = len(token_ids)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing token_ids, or none where no suffix occurred before."""
        self.extend(token_ids)
        end = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            j = self.follows.get(tuple(token_ids[end - n:]))
            if j is not None:
                return list(token_ids[j:min(j + k, end)])
        return []
