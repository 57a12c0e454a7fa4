"""Byte-level BPE: kvlab's GGUF and tokenizer.json loaders against the `tokenizers` reference.

A small ByteLevel BPE is trained in-process with each pre-tokenizer regex (Llama 3, Qwen 2,
GPT-2), then written both as a Hugging Face directory and as GGUF tokenizer metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's the dog's bone; they'll share it.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # simple\n",
    "for (int i = 0; i < 1024; ++i) { total += values[i] * 3.14159; }\n\n",
    "Prices rose 12.5% in 2023, from $1,299.99 to $1,461.24 per unit.",
    "日本語のテキストを分割します。中文分词测试。한국어 문장도 있습니다.",
    "Emoji: 😀 😃 😄 🎉 👍🏽 👨‍👩‍👧 and symbols ← → ∑ ∫ ≠ ≤.",
    "Ünïcödé façade naïve café résumé; Привет, как дела? Γειά σου κόσμε.",
    "    indented line\n\tTabbed line\r\nWindows line\n\n\nBlank lines above.",
    "I'M SHOUTING, YOU'RE LISTENING, WE'VE AGREED, THEY'D KNOWN.",
] * 20
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
            "<|endoftext|>"]
USER_DEFINED = ["<think>", "</think>"]

EVAL_TEXTS = [
    "Hello world", "The lazy dog's bone", "  two leading spaces", "trailing spaces   ",
    "a  b   c    d", "\n\n\nnewlines\n", "line\r\nbreaks\r\n", "tabs\t\tand\tmore",
    "1234567890 12.5% $1,299.99 3.14159265358979", "日本語の文章、中文分词。", "😀🎉👍🏽👨‍👩‍👧",
    "Ünïcödé ﬁ ligature ǅ Ⅻ ¹²³", "I'M HERE. You'Re there. they'LL go", "x = {'k': [1, 2, 3]}\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>text<|eot_id|>", "<think>reasoning</think>answer", "<|im_start", "",
    " ", "   \n   ", "zero\u200bwidth\u00a0nbsp", "mixed 中文 and English 123 😀!",
    "unseen words: xylophone quixotic zephyr 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _train(regex: str, ignore_merges: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.add_tokens(USER_DEFINED)
    return tok


def _write_gguf(tok: Tokenizer, pre: str, path: Path, bos: str | None) -> Path:
    spec = json.loads(tok.to_str())
    size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(size)]
    types = [3 if t in SPECIALS else 4 if t in USER_DEFINED else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = GGUFWriter(str(path), "llama" if bos else "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.token_to_id("<|eot_id|>" if bos else "<|im_end|>"))
    if bos:
        w.add_bos_token_id(tok.token_to_id(bos))
    w.add_add_bos_token(bos is not None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_hf_dir(tok: Tokenizer, path: Path, bos: str | None) -> Path:
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": "<|eot_id|>" if bos else "<|im_end|>",
              "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                               "{{ m.content }}<|im_end|>\n{% endfor %}"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# name -> (GGUF tokenizer.ggml.pre, split regex, ignore_merges, BOS written by the post-processor)
FAMILIES = {
    "llama3": ("llama-bpe", LLAMA3_REGEX, True, "<|begin_of_text|>"),
    "qwen2": ("qwen2", QWEN2_REGEX, False, None),
    "gpt2": ("gpt-2", GPT2_REGEX, False, None),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    pre, regex, ignore_merges, bos = FAMILIES[request.param]
    ref = _train(regex, ignore_merges)
    if bos:
        ref.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, ref.token_to_id(bos))])
    tmp = tmp_path_factory.mktemp(request.param)
    gguf_path = _write_gguf(ref, pre, tmp / "vocab.gguf", bos)
    hf_dir = _write_hf_dir(ref, tmp / "hf", bos)
    return {"ref": ref, "gguf": load_gguf_tokenizer(GGUFFile(gguf_path).metadata),
            "hf": load_hf_tokenizer(hf_dir), "bos": bos}


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_ids_match_reference(family, source):
    ref, tok = family["ref"], family[source]
    for text in EVAL_TEXTS + TRAIN_TEXT[:9]:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.encode(text, add_special_tokens=False) == \
            ref.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_decode_round_trip(family, source):
    ref, tok = family["ref"], family[source]
    for text in EVAL_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids,
                                                                       skip_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_special_ids(family, source):
    ref, tok = family["ref"], family[source]
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    eos = ref.token_to_id("<|eot_id|>" if family["bos"] else "<|im_end|>")
    assert tok.eos_ids[0] == eos
    for text in ("<|eot_id|>", "<|im_end|>", "<|endoftext|>"):  # end-of-turn tokens in vocab
        assert ref.token_to_id(text) in tok.eos_ids
    assert tok.add_bos == (family["bos"] is not None)
    assert tok.bos_id == (ref.token_to_id(family["bos"]) if family["bos"] else None)
    im_start = ref.token_to_id("<|im_start|>")
    think = ref.token_to_id("<think>")
    assert tok.is_special(im_start) and not tok.is_special(think)
    assert tok.token_bytes(think) == b"<think>"
    assert tok.token_bytes(ref.token_to_id("Ġthe")) == b" the"


def test_unsupported_pre_tokenizer_names_the_supported_ones(tmp_path):
    ref = _train(GPT2_REGEX, False)
    path = _write_gguf(ref, "no-such-pre", tmp_path / "v.gguf", None)
    with pytest.raises(ModelLoadError, match="supported: .*llama-bpe.*qwen2"):
        load_gguf_tokenizer(GGUFFile(path).metadata)
