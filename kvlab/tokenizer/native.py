"""The GGUF tokenizers' encoders in C (`kvlab.tokenizer._tok`), and the Python side of them.

Why hand-written C: prompts of many megabytes must tokenize at millions of tokens per second
while the Python reference (spm.py, bpe.py, merge.py, specials.py) manages 20,000-120,000,
and the ids must equal that reference's, which follows llama.cpp's semantics (space prefix,
leftmost-longest literal tokens, score-ordered merges with leftmost ties, byte fallback,
Llama 3's ignore_merges) rather than any library we could bind to. The C code mirrors the
reference step for step, so equal ids hold by construction; tests compare the two.

SentencePiece encodes a whole text in one C call. Byte-level BPE splits literal tokens in C,
cuts each run into words with the vocabulary's regex here, and merges the words in one C call
per run. Every call releases the GIL while it computes. When the extension is not built,
`AVAILABLE` is False and kvlab uses the Python reference.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from kvlab.tokenizer.pretokenize import PreTokenizer

try:
    from kvlab.tokenizer import _tok
except ImportError:  # not compiled: from_gguf falls back to the Python reference
    _tok = None

AVAILABLE = _tok is not None

Encoder = Callable[[str], list[int]]
_IGNORE_MERGES, _UTF8, _NEWLINE_WORDS = 1, 2, 4  # _tok.bpe options (TK_IGNORE_MERGES, ... in tok.h)
LSTRIP, RSTRIP = 1, 2  # strip flags (TK_LSTRIP, TK_RSTRIP)


def _flat(texts: Sequence[str]) -> tuple[bytes, array]:
    """All texts as one UTF-8 byte string plus each one's length in bytes."""
    encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
    return b"".join(encoded), array("q", map(len, encoded))


def spm_encoder(tokens: Sequence[str], scores: Sequence[float], literal_ids: Sequence[int],
                byte_ids: Sequence[int | None], unk_id: int | None,
                space_prefix: bool, strip: bytes = b"") -> Encoder:
    """`encode_text` of a SentencePiece vocabulary: literal tokens, space prefix and merges.

    `strip`: b"" or one byte per token, LSTRIP | RSTRIP for a literal token that swallows the
    ASCII whitespace before / after it.
    """
    text, lengths = _flat(tokens)
    model = _tok.spm(text, lengths, array("d", scores), array("q", literal_ids),
                     array("q", (-1 if i is None else i for i in byte_ids)),
                     -1 if unk_id is None else unk_id, space_prefix, strip)
    return model.encode


def bpe_encoder(tokens: Sequence[str], merges: Sequence[str], literal_ids: Sequence[int],
                pre: PreTokenizer, unk_id: int | None, strip: bytes = b"") -> Encoder:
    """`encode_text` of a BPE vocabulary (GGUF merges, "left right"): byte-level, or over
    UTF-8 code points with <0xNN> byte tokens when the pre-tokenizer is not byte-level."""
    text, lengths = _flat(tokens)
    merge_text, merge_lengths = _flat(merges)
    options = (_IGNORE_MERGES * pre.ignore_merges | _UTF8 * (not pre.byte_level)
               | _NEWLINE_WORDS * pre.newline_tokens)
    model = _tok.bpe(text, lengths, merge_text, merge_lengths, array("q", literal_ids),
                     -1 if unk_id is None else unk_id, options, strip)
    findall = pre.split
    split, encode_words = model.split, model.encode_words

    def encode_text(text: str) -> list[int]:
        ids: list[int] = []
        for piece in split(text):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += encode_words(findall(piece))
        return ids
    return encode_text
