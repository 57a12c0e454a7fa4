"""Building a `Tokenizer` from a Hugging Face model directory.

Encoding runs `tokenizer.json` through the `tokenizers` library, the reference implementation
of that format, so every normalizer / pre-tokenizer / model combination it describes is exact.
Around it: BOS, eos ids and the chat template come from `tokenizer_config.json`,
`generation_config.json` and `config.json`; token bytes for decoding are derived from the
decoder the file names (byte-level, or SentencePiece-style "▁" + `<0xNN>` byte fallback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from kvlab.errors import ModelLoadError
from kvlab.tokenizer.bpe import unicode_to_byte
from kvlab.tokenizer.fim import find_fim_tokens
from kvlab.tokenizer.from_gguf import END_OF_TURN_TOKENS
from kvlab.tokenizer.spm import SPACE_MARK
from kvlab.tokenizer.tokenizer import Tokenizer
from kvlab.tokenizer.wordpiece import wordpiece_from_hf

_SPM_DECODERS = {"Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_hf_tokenizer(model_dir: Path | str) -> Tokenizer:
    """A `Tokenizer` from `model_dir/tokenizer.json` and its config files."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no tokenizer.json; a Hugging Face model directory "
                             "needs one (tokenizer.model-only checkpoints are not supported)")
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception
        raise ModelLoadError(f"{path} cannot be read by the tokenizers library: {e}") from None
    if isinstance(hf.model, tokenizers.models.WordPiece):
        return wordpiece_from_hf(hf)
    decoder = json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else None
    config = _read_json(model_dir / "tokenizer_config.json")
    token_strings = {k: _token_text(config.get(k)) for k in _TEMPLATE_TOKENS}
    template_tokens = {k: v for k, v in token_strings.items() if v is not None}
    bos_id = _id_of(hf, token_strings["bos_token"])
    pieces, special = _pieces(hf, decoder)
    fim = find_fim_tokens(hf.get_vocab(with_added_tokens=True), len(pieces))

    def encode_text(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return Tokenizer(
        encode_text=encode_text,
        pieces=pieces,
        special=special,
        bos_id=bos_id,
        eos_ids=(_eos_ids(model_dir, hf, token_strings["eos_token"])
                 + list(fim.end_ids if fim else ())),
        add_bos=_add_bos(hf, config, bos_id),
        chat_template=_chat_template(model_dir, config),
        strip_leading_space=_strips_leading_space(decoder),
        template_tokens=template_tokens,
        fim=fim,
        suffix_id=_suffix_id(hf, config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_of(hf: tokenizers.Tokenizer, text: str | None) -> int | None:
    return None if text is None else hf.token_to_id(text)


def _decoder_types(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _decoder_types(sub)]
    return [decoder]


def _pieces(hf: tokenizers.Tokenizer, decoder: dict | None) -> tuple[list[bytes], list[bool]]:
    """Each id's bytes and whether it is special, from the vocabulary and the decoder."""
    kinds = {d.get("type") for d in _decoder_types(decoder)}
    byte_level = "ByteLevel" in kinds
    if not byte_level and kinds - _SPM_DECODERS:
        raise ModelLoadError(f"unsupported tokenizer.json decoder {sorted(kinds - _SPM_DECODERS)}; "
                             f"supported: ByteLevel, {', '.join(sorted(_SPM_DECODERS))}")
    vocab = hf.get_vocab(with_added_tokens=True)
    added = hf.get_added_tokens_decoder()
    size = max(vocab.values()) + 1
    pieces, special = [b""] * size, [False] * size
    to_byte = unicode_to_byte()
    for text, i in vocab.items():
        if i in added:
            pieces[i], special[i] = added[i].content.encode("utf-8"), bool(added[i].special)
        elif byte_level:
            pieces[i] = b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode("utf-8")
                                 for c in text)
        else:
            pieces[i] = _spm_piece_bytes(text)
    return pieces, special


def _spm_piece_bytes(text: str) -> bytes:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return text.replace(SPACE_MARK, " ").encode("utf-8")


def _strips_leading_space(decoder: dict | None) -> bool:
    """Does the decoder drop the space SentencePiece prefixed to the first word?"""
    for d in _decoder_types(decoder):
        if d.get("type") == "Strip" and d.get("start", 0) > 0 and d.get("content") == " ":
            return True
        if d.get("type") == "Metaspace":
            scheme = d.get("prepend_scheme", "always" if d.get("add_prefix_space") else "never")
            return scheme in ("always", "first")
    return False


def _add_bos(hf: tokenizers.Tokenizer, config: dict[str, Any], bos_id: int | None) -> bool:
    """tokenizer_config's add_bos_token if set, else whether the post-processor adds BOS."""
    if bos_id is None:
        return False
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"]
    return hf.encode("", add_special_tokens=True).ids[:1] == [bos_id]


def _suffix_id(hf: tokenizers.Tokenizer, config: dict[str, Any]) -> int | None:
    """The token the post-processor appends after a text (Qwen3-Embedding's
    <|endoftext|>), unless tokenizer_config's add_eos_token says False."""
    if config.get("add_eos_token") is False:
        return None
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):  # the text's ids, then what follows
        if full[start:start + len(plain)] == plain:
            tail = full[start + len(plain):]
            return tail[-1] if tail else None
    return None


def _eos_ids(model_dir: Path, hf: tokenizers.Tokenizer, eos_text: str | None) -> list[int]:
    ids: list[int | None] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        ids += value if isinstance(value, list) else [value]
    ids.append(_id_of(hf, eos_text))
    ids += [hf.token_to_id(text) for text in END_OF_TURN_TOKENS]
    return [i for i in ids if isinstance(i, int)]


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """From tokenizer_config.json, or chat_template.jinja / chat_template.json beside it."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(model_dir / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
