"""Unigram tokenizers (T5, XLM-RoBERTa: GGUF `tokenizer.ggml.model` = "t5", llama.cpp's UGM),
encoded by the `tokenizers` library.

The library's Unigram model (Viterbi over token log-probabilities, one fused unknown token
scored at the lowest score minus 10) is the reference for this scheme, so no Viterbi is
written by hand here. Its `Precompiled` normalizer is not used: it looks a grapheme up
whole or one character at a time, where SentencePiece and llama.cpp replace the longest
matching byte sequence, so decomposed Hangul, Indic two-part vowels and stacked accents
come out differently; `_Charsmap` walks the charsmap as llama.cpp does. After the charsmap,
llama.cpp drops spaces at both ends and merges runs of spaces (`remove_extra_whitespaces`),
writes each space as U+2581 and puts one U+2581 before the first word (`add_space_prefix`).
The Viterbi runs over the whole normalized text, not word by word, so Metaspace only
escapes the spaces and does not split. Control tokens are not Unigram pieces in llama.cpp:
they are matched in the text first, as are user-defined tokens (which skip the charsmap and
score 0).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, NormalizedString, Regex, models, normalizers, pre_tokenizers

from kvlab.errors import ModelLoadError
from kvlab.tokenizer.spm import SPACE_MARK
from kvlab.tokenizer.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5  # tokenizer.ggml.token_type
_SPECIAL_TYPES = (UNKNOWN, CONTROL, UNUSED)  # hidden when decoding skips specials
_UNREACHABLE = "\x00"  # prefixed to a piece llama.cpp's Viterbi never considers


def unigram_from_gguf(metadata: dict[str, Any], lstrip_ids: Sequence[int] = ()) -> Tokenizer:
    """From llama.cpp's `t5` vocabulary: tokens, scores, types, the precompiled charsmap and
    the whitespace switches. `lstrip_ids`: literal tokens that swallow the spaces before them
    (llama.cpp sets these per model)."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens vocabulary")
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelLoadError("Unigram GGUF vocabulary has no tokenizer.ggml.scores")
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    # llama.cpp's defaults for t5: <pad> 0, </s> 1, <unk> 2, no BOS
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 2)
    if not 0 <= unk_id < len(tokens):
        raise ModelLoadError(f"Unigram GGUF vocabulary has no unknown token: "
                             f"tokenizer.ggml.unknown_token_id={unk_id} is outside the "
                             f"vocabulary of {len(tokens)} tokens")
    hf = tokenizers.Tokenizer(models.Unigram(_pieces(tokens, scores, types), unk_id=unk_id,
                                             byte_fallback=False))
    hf.normalizer = _normalizer(metadata)
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="never",
                                                split=False)
    lstrip = set(lstrip_ids)
    hf.add_tokens([AddedToken(t, special=True, normalized=False, lstrip=i in lstrip)
                   for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, UNKNOWN)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False, lstrip=i in lstrip)
                   for i, (t, ty) in enumerate(zip(tokens, types)) if ty == USER_DEFINED
                   or (i in lstrip and ty not in (CONTROL, UNKNOWN))])

    # the library numbers a literal token whose piece is unreachable past the vocabulary
    own_id = {hf.token_to_id(t): i for i, t in enumerate(tokens) if hf.token_to_id(t) != i}

    def encode_text(text: str) -> list[int]:
        ids = hf.encode(text, add_special_tokens=False).ids
        return [own_id.get(i, i) for i in ids] if own_id else ids

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id", 1 if len(tokens) > 1 else None)
    # llama.cpp's defaults for t5: no BOS, EOS appended
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", True))
    return Tokenizer(
        encode_text=encode_text,
        pieces=[_piece(t, ty) for t, ty in zip(tokens, types)],
        special=[ty in _SPECIAL_TYPES for ty in types],
        bos_id=bos_id,
        eos_ids=[eos_id] if eos_id is not None else [],
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None,
        chat_template=metadata.get("tokenizer.chat_template"),
        strip_leading_space=_prefixes_words(metadata),
        suffix_id=eos_id if add_eos else None)


def _pieces(tokens: Sequence[str], scores: Sequence[float],
            types: Sequence[int]) -> list[tuple[str, float]]:
    """The Unigram pieces, scored so that the library's unknown score (lowest score - 10) is
    llama.cpp's (lowest normal score - 10).

    llama.cpp's Viterbi matches normal, user-defined (score 0) and unused tokens. Control and
    unknown tokens, and unused ones scored below every normal token (XLM-R's -10000 padding,
    never chosen over 10-point pieces), become unreachable pieces at the lowest normal score.
    """
    floor = min((float(s) for s, ty in zip(scores, types) if ty == NORMAL), default=0.0)
    out = []
    for text, score, ty in zip(tokens, scores, types):
        if ty == USER_DEFINED:
            out.append((text, 0.0))
        elif ty == NORMAL or (ty == UNUSED and score >= floor):
            out.append((text, float(score)))
        else:
            out.append((_UNREACHABLE + text, floor))
    return out


def _normalizer(metadata: dict[str, Any]) -> normalizers.Normalizer:
    """Charsmap, then llama.cpp's space rules (spaces still plain " ", Metaspace escapes)."""
    steps: list[normalizers.Normalizer] = []
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap) > 0:
        steps.append(normalizers.Normalizer.custom(
            _Charsmap(bytes(int(b) & 0xFF for b in charsmap))))
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", False):
        # "  a  b " -> "a b": no space at either end, one between words (and one before the
        # first word: llama.cpp puts a space before every word when it merges spaces)
        steps += [normalizers.Replace(Regex(" +\\z"), ""), normalizers.Replace(Regex("\\A +"), ""),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if _prefixes_words(metadata):
        # one space before the text (llama.cpp puts it before the first word: the same
        # string once spaces are U+2581, except a text of spaces only, which gains none there)
        steps.append(normalizers.Prepend(" "))
    return normalizers.Sequence(steps)


class _Charsmap:
    """SentencePiece's precompiled charsmap, applied as SentencePiece and llama.cpp apply it:
    at each position the longest matching byte sequence is replaced.

    The charsmap is a double array (XOR-compressed, Kanda 2018) over UTF-8 bytes: each 32-bit
    node holds BASE (bits 10-30, shifted when bit 9 is set), a leaf bit (8) and the byte
    that leads to it (LCHECK, bits 0-7); a leaf's child holds the offset of its NUL-ended
    replacement in the strings after the array.
    """

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 4:
            raise ModelLoadError(f"tokenizer.ggml.precompiled_charsmap has {len(blob)} bytes, "
                                 "too few for its header")
        (size,) = struct.unpack_from("<I", blob)
        if 4 + size > len(blob) or size % 4:
            raise ModelLoadError(f"tokenizer.ggml.precompiled_charsmap declares {size} bytes "
                                 f"of nodes in a blob of {len(blob)}")
        self._nodes = struct.unpack_from(f"<{size // 4}I", blob, 4)
        self._strings = blob[4 + size:]

    def normalize(self, normalized: NormalizedString) -> None:
        text = normalized.normalized
        new = self.apply(text)
        if new != text:
            normalized.replace(text, new)

    def apply(self, text: str) -> str:
        data = text.encode("utf-8")
        out = bytearray()
        i = 0
        while i < len(data):
            length, offset = self._longest_match(data, i)
            if length:
                out += self._strings[offset:self._strings.index(b"\0", offset)]
                i += length
            else:  # one character as it is
                j = i + 1
                while j < len(data) and data[j] & 0xC0 == 0x80:
                    j += 1
                out += data[i:j]
                i = j
        return out.decode("utf-8", errors="replace")

    def _longest_match(self, data: bytes, start: int) -> tuple[int, int]:
        """(bytes matched, replacement offset) of the longest entry at data[start:]."""
        nodes = self._nodes
        node, best = _base(nodes[0]), (0, 0)
        for pos in range(start, len(data)):
            byte = data[pos]
            if byte == 0:
                break
            node ^= byte
            if node >= len(nodes) or nodes[node] & 0x800000FF != byte:
                break
            packed = nodes[node]
            node ^= _base(packed)
            if packed >> 8 & 1 and node < len(nodes):
                best = (pos - start + 1, nodes[node] & 0x7FFFFFFF)
        return best


def _base(packed: int) -> int:
    return (packed >> 10) << ((packed & (1 << 9)) >> 6)


def _prefixes_words(metadata: dict[str, Any]) -> bool:
    """Whether the first word gains a space (llama.cpp reads no whitespace-as-suffix or
    escape switch for t5: spaces are always U+2581, always before a word)."""
    return bool(metadata.get("tokenizer.ggml.add_space_prefix", False)
                or metadata.get("tokenizer.ggml.remove_extra_whitespaces", False))


def _piece(text: str, token_type: int) -> bytes:
    """The bytes a token decodes to: in a normal token U+2581 is a space; the others are
    written as-is."""
    if token_type != NORMAL:
        return text.encode("utf-8")
    return text.replace(SPACE_MARK, " ").encode("utf-8")
