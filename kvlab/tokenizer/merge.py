"""Greedy pair merging, shared by the BPE (merge ranks) and SentencePiece (scores) tokenizers.

Symbols form a doubly linked list; a heap holds candidate adjacent pairs by priority, and a
popped pair is stale when either side was merged away or has grown since it was pushed.
Each merge is O(log n), so long runs without whitespace stay fast.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

Priority = Callable[[str, str], float | None]  # lower merges first; None: not mergeable


def merge_symbols(syms: list[str], priority: Priority) -> list[str]:
    """Merge adjacent symbols best-priority first (ties: leftmost); returns the result."""
    n = len(syms)
    if n < 2:
        return syms
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        key = priority(syms[left], syms[right])
        if key is not None:
            heapq.heappush(heap, (key, left, right, len(syms[left]) + len(syms[right])))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        ls, rs = syms[left], syms[right]
        if not ls or not rs or len(ls) + len(rs) != size:
            continue  # stale
        syms[left], syms[right] = ls + rs, ""
        after = nxt[right]
        nxt[left] = after
        if after != -1:
            prv[after] = left
            push(left, after)
        if prv[left] != -1:
            push(prv[left], left)
    return [s for s in syms if s]
