"""Byte-level BPE (GPT-2 family: Llama 3, Qwen 2): regex pre-split, byte alphabet, ranked merges.

Text is cut into words by the vocabulary's pre-tokenizer (pretokenize.py, keyed by GGUF's
`tokenizer.ggml.pre`), each word's UTF-8 bytes are spelled in GPT-2's printable byte alphabet,
and adjacent pairs merge in order of merge rank (lowest first, ties leftmost) using a heap.
Words repeat a lot, so results are memoised per word. A pre-tokenizer that is not byte-level
(Gemma 4's) merges the word's characters as they are and falls back to `<0xNN>` byte tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from kvlab.tokenizer.merge import merge_symbols
from kvlab.tokenizer.pretokenize import PreTokenizer


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in byte_to_unicode().items()}


class ByteLevelBPE:
    """Encodes ordinary text (no special tokens) with rank-ordered byte-level merges."""

    _CACHE_LIMIT = 65536  # words; cleared when full, so memory stays bounded

    def __init__(self, token_to_id: dict[str, int], merges: Sequence[str],
                 pre: PreTokenizer, unk_id: int | None = None) -> None:
        self._token_to_id = token_to_id
        self._ranks = {_merge_pair(m): rank for rank, m in enumerate(merges)}
        self._pre = pre
        self._unk_id = unk_id
        # latin-1 decoding turns each byte into the char of the same number; translate respells it.
        self._spell = {b: ch for b, ch in byte_to_unicode().items()}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self._pre.split(text):
            cached = self._cache.get(word)
            if cached is None:
                cached = self._encode_word(word)
                if len(self._cache) >= self._CACHE_LIMIT:
                    self._cache.clear()
                self._cache[word] = cached
            ids.extend(cached)
        return ids

    def _encode_word(self, word: str) -> list[int]:
        pre = self._pre
        spelled = (word.encode("utf-8").decode("latin-1").translate(self._spell)
                   if pre.byte_level else word)
        whole = pre.ignore_merges or (pre.newline_tokens and not word.strip("\n"))
        if whole and spelled in self._token_to_id:
            return [self._token_to_id[spelled]]
        ids: list[int | None] = []
        for sym in self._merge(list(spelled)):
            token_id = self._token_to_id.get(sym)
            if token_id is not None:
                ids.append(token_id)
            elif pre.byte_level:  # not a token: its single characters are, in any such vocabulary
                ids.extend(self._token_to_id.get(ch, self._unk_id) for ch in sym)
            else:  # raw UTF-8 vocabularies spell bytes as <0xNN>
                ids.extend(self._token_to_id.get(f"<0x{b:02X}>") for b in sym.encode("utf-8"))
        return [i for i in ids if i is not None]

    def _merge(self, syms: list[str]) -> list[str]:
        """Apply merges by rank (ties: leftmost)."""
        return merge_symbols(syms, lambda left, right: self._ranks.get((left, right)))


def _merge_pair(merge: str | Sequence[str]) -> tuple[str, str]:
    """GGUF stores a merge as "left right"; tokenizer.json as that string or a 2-list.

    As llama.cpp reads it, the separator is the first space after the first character.
    """
    if isinstance(merge, str):
        cut = merge.find(" ", 1)
        return (merge[:cut], merge[cut + 1:]) if cut > 0 else ("", "")
    return merge[0], merge[1]
