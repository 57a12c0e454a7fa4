"""Byte-level BPE (GPT-2 family: Llama 3, Qwen 2): regex pre-split, byte alphabet, ranked merges.

Text is cut into words by the pre-tokenizer regex of the vocabulary (a table keyed by GGUF's
`tokenizer.ggml.pre`), each word's UTF-8 bytes are spelled in GPT-2's printable byte alphabet,
and adjacent pairs merge in order of merge rank (lowest first, ties leftmost) using a heap.
Words repeat a lot, so results are memoised per word.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import regex

from kvlab.errors import ModelLoadError
from kvlab.tokenizer.merge import merge_symbols

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizer:
    """How one family of vocabularies splits text into words before merging."""

    def __init__(self, pattern: str, ignore_merges: bool = False) -> None:
        self.pattern = pattern
        # Llama 3 emits a word that is already a vocabulary token whole, skipping the merges.
        self.ignore_merges = ignore_merges


_LLAMA3 = PreTokenizer(LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = PreTokenizer(QWEN2_SPLIT)
_GPT2 = PreTokenizer(GPT2_SPLIT)
_GPT4O = PreTokenizer(GPT4O_SPLIT)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {  # GGUF tokenizer.ggml.pre -> pre-tokenizer
    "default": _GPT2, "gpt-2": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        raise ModelLoadError(
            f"unsupported byte-level BPE pre-tokenizer tokenizer.ggml.pre={name!r}; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}") from None


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
        self._split = regex.compile(pre.pattern)
        self._ignore_merges = pre.ignore_merges
        self._unk_id = unk_id
        # latin-1 decoding turns each byte into the char of the same number; translate respells it.
        self._spell = {b: ch for b, ch in byte_to_unicode().items()}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self._split.findall(text):
            cached = self._cache.get(word)
            if cached is None:
                cached = self._encode_word(word)
                if len(self._cache) >= self._CACHE_LIMIT:
                    self._cache.clear()
                self._cache[word] = cached
            ids.extend(cached)
        return ids

    def _encode_word(self, word: str) -> list[int]:
        spelled = word.encode("utf-8").decode("latin-1").translate(self._spell)
        if self._ignore_merges and spelled in self._token_to_id:
            return [self._token_to_id[spelled]]
        ids: list[int] = []
        for sym in self._merge(list(spelled)):
            token_id = self._token_to_id.get(sym)
            if token_id is not None:
                ids.append(token_id)
            else:  # not a token: its single characters are, in any byte-level vocabulary
                ids.extend(self._token_to_id.get(ch, self._unk_id) for ch in sym)
        return [i for i in ids if i is not None]

    def _merge(self, syms: list[str]) -> list[str]:
        """Apply merges by rank (ties: leftmost)."""
        return merge_symbols(syms, lambda left, right: self._ranks.get((left, right)))


def _merge_pair(merge: str | Sequence[str]) -> tuple[str, str]:
    """GGUF stores a merge as "left right"; tokenizer.json as that string or a 2-list."""
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return left, right
    return merge[0], merge[1]
