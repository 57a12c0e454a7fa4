"""Hugging Face directories: a SentencePiece-style tokenizer.json (Metaspace, byte fallback) and
the config files around it (eos ids, BOS, chat template locations, errors)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import IncrementalDetokenizer, load_hf_tokenizer

TRAIN = ["Hello world, hello tokenizer.", "The quick brown fox jumps over the lazy dog.",
         "Streaming text arrives one token at a time.", "def f(x):\n    return x"] * 10
TEXTS = ["Hello world", " two  spaces", "The lazy fox", "emoji 😀 and 日本語 fall back to bytes",
         "<s>literal bos", "tabs\tand\nnewlines", ""]


def _llama2_style() -> Tokenizer:
    """A Llama-2-like tokenizer.json: normalizer prepends "▁" and spells spaces "▁", BPE with
    `<0xNN>` byte fallback, and a decoder that strips the prefix space again."""
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    base.train_from_iterator(TRAIN, trainer)
    spec = json.loads(base.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama2")
    _llama2_style().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
         "add_bos_token": True, "chat_template": [{"name": "tool_use", "template": "T"},
                                                  {"name": "default", "template": "D"}]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return path


def test_ids_and_decode_match_tokenizers(llama2_dir):
    ref = Tokenizer.from_file(str(llama2_dir / "tokenizer.json"))
    tok = load_hf_tokenizer(llama2_dir)
    assert tok.bos_id == 1 and tok.add_bos and tok.strip_leading_space
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [1, *ref.encode(text, add_special_tokens=False).ids], text
        assert tok.decode(ids) == ref.decode(ids) == text.replace("<s>", "", 1 if text else 0)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(
            ids, skip_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tok.decode(ids) and "\ufffd" not in "".join(deltas)


def test_config_files(llama2_dir):
    tok = load_hf_tokenizer(llama2_dir)
    assert tok.eos_ids[:2] == (2, 7)  # generation_config first, then eos_token "</s>" (2)
    assert tok.chat_template == "D"  # the "default" of several named templates
    assert tok.is_special(1) and not tok.is_special(tok.encode("Hello", False)[0])


def test_chat_template_jinja_file(tmp_path):
    _llama2_style().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    tok = load_hf_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    assert tok.bos_id is None and not tok.add_bos  # no tokenizer_config.json at all


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_hf_tokenizer(tmp_path)


def test_unreadable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizers library"):
        load_hf_tokenizer(tmp_path)


def test_unsupported_decoder(tmp_path):
    tok = _llama2_style()
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="WordPiece.*supported: ByteLevel"):
        load_hf_tokenizer(tmp_path)
