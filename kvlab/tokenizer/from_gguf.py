"""Building a `Tokenizer` from GGUF tokenizer metadata, with llama.cpp's semantics.

`tokenizer.ggml.model` picks the subword model, as llama.cpp dispatches on it: "llama" is
SentencePiece-style BPE (scores, byte fallback, U+2581 spaces), "gpt2" is byte-level BPE
(ranked merges, a pre-tokenizer chosen by `tokenizer.ggml.pre`, table in pretokenize.py),
"gemma4" is BPE with ranked merges over raw UTF-8 with U+2581 spaces (pre-tokenizer "gemma4"),
"bert" is WordPiece (built in wordpiece.py), "t5" is T5's Unigram (UGM, built in unigram.py).
RWKV ("rwkv") is not implemented and fails to load with a message saying so. Token types
decide the rest: control, unknown and user-defined tokens written in the text are matched
literally first; control, unknown and unused tokens are "special" (hidden when decoding skips
specials).

Encoding runs in C (kvlab/tokenizer/native.py) when the extension is built, else in the
pure-Python reference (spm.py, bpe.py, specials.py); both give the same ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import native
from kvlab.tokenizer.bpe import ByteLevelBPE, unicode_to_byte
from kvlab.tokenizer.chat import FALLBACK_TEMPLATES
from kvlab.tokenizer.fim import find_fim_tokens
from kvlab.tokenizer.pretokenize import PreTokenizer, pre_tokenizer_for
from kvlab.tokenizer.specials import SpecialSplitter
from kvlab.tokenizer.spm import SPACE_MARK, SentencePieceBPE
from kvlab.tokenizer.tokenizer import Tokenizer
from kvlab.tokenizer.unigram import unigram_from_gguf
from kvlab.tokenizer.wordpiece import wordpiece_from_gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type
_LITERAL_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)  # matched in raw text before subword merging
_SPECIAL_TYPES = (UNKNOWN, CONTROL, UNUSED)
SUPPORTED_MODELS = {"llama": "SentencePiece BPE", "gpt2": "byte-level BPE",
                    "gemma4": "BPE over UTF-8", "bert": "WordPiece (kvlab.tokenizer.wordpiece)",
                    "t5": "Unigram (kvlab.tokenizer.unigram)"}
_UNSUPPORTED_MODELS = {"rwkv": "RWKV's trie tokenizer",
                       "plamo2": "PLaMo 2's tokenizer"}

# Tokens that end a turn in common chat formats; each one in the vocabulary also stops generation.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class _Vocab:
    """What both subword models need from the metadata."""

    metadata: dict[str, Any]
    tokens: list[str]
    types: Sequence[int]
    token_to_id: dict[str, int]
    literal: list[tuple[str, int]]  # (text, id) of tokens matched literally before merging
    strip: bytes  # b"" or per token LSTRIP | RSTRIP: the whitespace a literal token swallows
    space_prefix: bool
    native: bool  # encode with the C extension (else the Python reference)
    pre: PreTokenizer | None  # BPE: how text is cut into words; SentencePiece: None


def load_gguf_tokenizer(metadata: dict[str, Any], native_encoder: bool | None = None) -> Tokenizer:
    """A `Tokenizer` from GGUF metadata (plain values, as `GGUFFile(path).metadata` gives).

    `native_encoder`: encode in C (default: when kvlab.tokenizer._tok is built) or, False,
    with the pure-Python reference; the ids are the same.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODELS.items())
        known = (f" ({_UNSUPPORTED_MODELS[model]} is not implemented)"
                 if model in _UNSUPPORTED_MODELS else "")
        raise ModelLoadError(f"unsupported tokenizer model tokenizer.ggml.model={model!r}"
                             f"{known}; supported: {supported}")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens vocabulary")
    _check_vocabulary(metadata, len(tokens))
    if model == "bert":
        return wordpiece_from_gguf(metadata)
    if model == "t5":
        return _unigram(metadata)
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    token_to_id = {text: i for i, text in enumerate(tokens)}
    is_spm = model == "llama"
    # llama.cpp names Gemma 4's pre-tokenizer itself, whatever the file says
    pre = None if is_spm else pre_tokenizer_for(
        "gemma4" if model == "gemma4" else metadata.get("tokenizer.ggml.pre", "default"))
    space_prefix = is_spm and bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    literal = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in _LITERAL_TYPES]
    vocab = _Vocab(metadata, tokens, types, token_to_id, literal,
                   _strip_flags(metadata, tokens, token_to_id, literal), space_prefix,
                   _use_native(native_encoder), pre)
    encode_text, pieces = _spm_parts(vocab) if is_spm else _bpe_parts(vocab)
    arch = metadata.get("general.architecture", "")
    template = metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATES.get(arch)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    fim = find_fim_tokens(token_to_id, len(tokens), metadata)
    return Tokenizer(
        encode_text=encode_text,
        pieces=pieces,
        special=[ty in _SPECIAL_TYPES for ty in types],
        bos_id=bos_id,
        eos_ids=_eos_ids(metadata, token_to_id) + list(fim.end_ids if fim else ()),
        add_bos=_add_bos(metadata, pre) and bos_id is not None,
        chat_template=template,
        strip_leading_space=space_prefix,
        template_tokens=_template_tokens(metadata, tokens),
        fim=fim,
        # an embedding model's EOS, appended as llama.cpp appends it (add_eos_token)
        suffix_id=(metadata.get("tokenizer.ggml.eos_token_id")
                   if metadata.get("tokenizer.ggml.add_eos_token") else None),
    )


def _unigram(metadata: dict[str, Any]) -> Tokenizer:
    """T5's Unigram, with llama.cpp's per-model whitespace stripping around literal tokens."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    token_to_id = {text: i for i, text in enumerate(tokens)}
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    literal = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in _LITERAL_TYPES]
    strip = _strip_flags(metadata, tokens, token_to_id, literal)
    return unigram_from_gguf(metadata, [i for i, f in enumerate(strip) if f & native.LSTRIP])


def _use_native(requested: bool | None) -> bool:
    if requested and not native.AVAILABLE:
        raise ModelLoadError("the C tokenizer kvlab.tokenizer._tok is not built; run "
                             "`python setup.py build_ext --inplace` or `pip install -e .`")
    return native.AVAILABLE if requested is None else requested


def _check_vocabulary(metadata: dict[str, Any], n_tokens: int) -> None:
    """A vocabulary whose lists disagree, or that names tokens it does not have, fails here
    with the key that is wrong, before any table is built from it."""
    _check_length(metadata, "tokenizer.ggml.token_type", n_tokens)
    _check_length(metadata, "tokenizer.ggml.scores", n_tokens)
    _check_token_ids(metadata, n_tokens)
    types = metadata.get("tokenizer.ggml.token_type") or ()
    bad = next((i for i, t in enumerate(types) if not (isinstance(t, int) and 0 <= t <= BYTE)),
               None)
    if bad is not None:
        raise ModelLoadError(f"GGUF tokenizer metadata is inconsistent: tokenizer.ggml."
                             f"token_type[{bad}] is {types[bad]!r}; token types are 0 "
                             f"(undefined) to {BYTE} (byte)")


def _check_length(metadata: dict[str, Any], key: str, n_tokens: int) -> None:
    values = metadata.get(key)
    if values is not None and len(values) != n_tokens:
        raise ModelLoadError(f"GGUF tokenizer metadata is inconsistent: {key} has {len(values)} "
                             f"entries, tokenizer.ggml.tokens has {n_tokens}")


def _check_token_ids(metadata: dict[str, Any], n_tokens: int) -> None:
    """The ids kvlab adds, emits or stops on must be tokens (an optional marker such as a FIM
    one, or a padding or mask id kvlab never reads, outside the vocabulary is only absent, as
    llama.cpp treats it)."""
    for name in ("bos", "eos", "eot", "eom", "unknown", "seperator", "cls"):
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key)
        if isinstance(value, int) and not 0 <= value < n_tokens:
            raise ModelLoadError(f"GGUF tokenizer metadata is inconsistent: {key}={value} is "
                                 f"outside the vocabulary of {n_tokens} tokens")


def _strip_flags(metadata: dict[str, Any], tokens: list[str], token_to_id: dict[str, int],
                 literal: list[tuple[str, int]]) -> bytes:
    """llama.cpp's per-model whitespace stripping around literal tokens.

    GGUF does not store these attributes, so llama.cpp sets them by model name, pre-tokenizer
    or architecture; the rules are the same here, in this one place.
    """
    name = str(metadata.get("general.name", "")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", ""))
    arch = str(metadata.get("general.architecture", ""))
    flags: dict[int, int] = {}
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        flags[token_to_id.get("<mask>", -1)] = native.LSTRIP
    elif "phi-3" in name or "phi3" in name:
        flags.update({i: native.RSTRIP for _, i in literal})
        flags[token_to_id.get("</s>", -1)] = native.RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            flags.pop(token_to_id.get(text, -1), None)
    elif "modern-bert" in name:
        flags[token_to_id.get("[MASK]", -1)] = native.LSTRIP
    flags.pop(-1, None)
    if not flags:
        return b""
    out = bytearray(len(tokens))
    for token_id, flag in flags.items():
        out[token_id] = flag
    return bytes(out)


def _add_bos(metadata: dict[str, Any], pre: PreTokenizer | None) -> bool:
    """The GGUF's add_bos_token, else llama.cpp's default (SentencePiece and a few BPEs)."""
    default = pre is None or bool(pre.add_bos)
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default)) or bool(
        pre and pre.always_bos)


def _splitter(v: _Vocab) -> SpecialSplitter:
    """The Python reference's literal-token splitter, with the vocabulary's strip flags."""
    lstrip = [i for i, f in enumerate(v.strip) if f & native.LSTRIP]
    rstrip = [i for i, f in enumerate(v.strip) if f & native.RSTRIP]
    return SpecialSplitter(v.literal, lstrip, rstrip)


def _fragment_encoder(splitter: SpecialSplitter, subword: Callable[[str], list[int]],
                      space_prefix: bool) -> Callable[[str], list[int]]:
    """Literal tokens first, the subword model on the text between them.

    With a space prefix, llama.cpp prefixes " " to every text run at the start or right after
    a literal token.
    """
    def encode_text(text: str) -> list[int]:
        ids: list[int] = []
        after_literal = True
        for piece in splitter.split(text):
            if isinstance(piece, int):
                ids.append(piece)
                after_literal = True
            else:
                ids.extend(subword(" " + piece if space_prefix and after_literal else piece))
                after_literal = False
        return ids
    return encode_text


def _spm_parts(v: _Vocab) -> tuple[Callable[[str], list[int]], list[bytes]]:
    scores = v.metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelLoadError("SentencePiece GGUF vocabulary has no tokenizer.ggml.scores")
    byte_ids: list[int | None] = [None] * 256
    pieces: list[bytes] = []
    for i, (text, ty) in enumerate(zip(v.tokens, v.types)):
        byte = _byte_token_value(text) if ty == BYTE else None
        if byte is not None:
            byte_ids[byte] = i
            pieces.append(bytes([byte]))
        elif ty in (CONTROL, USER_DEFINED):  # written as-is, like llama.cpp
            pieces.append(text.encode("utf-8"))
        else:
            pieces.append(text.replace(SPACE_MARK, " ").encode("utf-8"))
    unk_id = v.metadata.get("tokenizer.ggml.unknown_token_id")
    if v.native:
        literal_ids = [i for _, i in v.literal]
        return native.spm_encoder(v.tokens, scores, literal_ids, byte_ids, unk_id,
                                  v.space_prefix, v.strip), pieces
    spm = SentencePieceBPE(v.token_to_id, scores, byte_ids, unk_id)
    return _fragment_encoder(_splitter(v), spm.encode, v.space_prefix), pieces


def _bpe_parts(v: _Vocab) -> tuple[Callable[[str], list[int]], list[bytes]]:
    pre = v.pre
    assert pre is not None
    merges = v.metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError("BPE GGUF vocabulary has no tokenizer.ggml.merges")
    pieces = _byte_level_pieces(v) if pre.byte_level else _utf8_pieces(v)
    unk_id = v.metadata.get("tokenizer.ggml.unknown_token_id")
    if v.native:
        literal_ids = [i for _, i in v.literal]
        return native.bpe_encoder(v.tokens, merges, literal_ids, pre, unk_id, v.strip), pieces
    bpe = ByteLevelBPE(v.token_to_id, merges, pre, unk_id)
    return _fragment_encoder(_splitter(v), bpe.encode, v.space_prefix), pieces


def _byte_level_pieces(v: _Vocab) -> list[bytes]:
    to_byte = unicode_to_byte()
    pieces: list[bytes] = []
    for text, ty in zip(v.tokens, v.types):
        byte = _byte_token_value(text) if ty == BYTE else None
        if byte is not None:
            pieces.append(bytes([byte]))
        elif ty in (NORMAL, UNUSED):  # spelled in GPT-2's byte alphabet
            pieces.append(b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode("utf-8")
                                   for c in text))
        else:  # control and user-defined tokens are stored as plain text
            pieces.append(text.encode("utf-8"))
    return pieces


def _utf8_pieces(v: _Vocab) -> list[bytes]:
    """Raw UTF-8 tokens with U+2581 for spaces and <0xNN> byte tokens (Gemma 4)."""
    pieces: list[bytes] = []
    for text, ty in zip(v.tokens, v.types):
        byte = _byte_token_value(text) if ty == BYTE else None
        if byte is not None:
            pieces.append(bytes([byte]))
        elif ty in (CONTROL, USER_DEFINED):
            pieces.append(text.encode("utf-8"))
        else:
            pieces.append(text.replace(SPACE_MARK, " ").encode("utf-8"))
    return pieces


def _byte_token_value(text: str) -> int | None:
    """0xNN for a byte token spelled "<0xNN>"."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _eos_ids(metadata: dict[str, Any], token_to_id: dict[str, int]) -> list[int]:
    ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [token_to_id.get(text) for text in END_OF_TURN_TOKENS]
    return [i for i in ids if i is not None]


def _template_tokens(metadata: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """bos_token/eos_token/... strings for chat templates, as transformers passes them."""
    out = {}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            out[f"{key}_token"] = tokens[token_id]
    return out
