"""llama.cpp's own tokenizer test vectors, id for id, for every vocabulary it ships with them.

llama.cpp's tests/test-tokenizer-0 reads `ggml-vocab-NAME.gguf.inp` (texts separated by
"\\n__ggml_vocab_test__\\n") and `.out` (one line of space-separated ids per text) and encodes
each text without BOS/EOS; so does this test, with the C encoder and with the Python
reference. The files come from `make test` (KVLAB_LLAMA_VOCABS names their folder); without
them those tests skip. The rest checks that a vocabulary kvlab cannot use fails to load with a
ModelLoadError that says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlab.errors import ModelLoadError
from kvlab.tokenizer import load_gguf_tokenizer, native
from kvlab.tokenizer.pretokenize import PRE_TOKENIZERS
from kvlab.weights.gguf_file import GGUFFile

SEPARATOR = "\n__ggml_vocab_test__\n"
# The vocabularies llama.cpp ships with test vectors (at least these).
EXPECTED = ("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
            "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact",
            "starcoder")
ENCODERS = [True, False] if native.AVAILABLE else [False]  # native_encoder


def _folder() -> Path | None:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    return Path(folder) if folder and Path(folder).is_dir() else None


def _vocab_paths() -> list[Path]:
    folder = _folder()
    if folder is None:
        return []
    return sorted(p for p in folder.glob("ggml-vocab-*.gguf")
                  if Path(f"{p}.inp").is_file() and Path(f"{p}.out").is_file())


def _name(path: Path) -> str:
    return path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs, read as llama.cpp's test-tokenizer-0 reads them."""
    raw = Path(f"{path}.inp").read_text(encoding="utf-8")
    texts = raw.removesuffix(SEPARATOR).split(SEPARATOR) if raw else []  # no text after the last
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{path.name}: {len(texts)} inputs, {len(lines)} outputs"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


_SKIP = pytest.mark.skipif(
    not _vocab_paths(),
    reason="set KVLAB_LLAMA_VOCABS to a folder of llama.cpp's ggml-vocab-*.gguf with their "
           ".inp/.out test vectors (`make test` fetches them)")


@_SKIP
def test_every_vocabulary_with_vectors_is_present():
    missing = sorted(set(EXPECTED) - {_name(p) for p in _vocab_paths()})
    assert not missing, f"no test vectors for {missing} in {_folder()}"


@_SKIP
@pytest.mark.parametrize("native_encoder", ENCODERS, ids=lambda n: "c" if n else "python")
@pytest.mark.parametrize("path", _vocab_paths(), ids=_name)
def test_llama_cpp_vectors(path, native_encoder):
    tok = load_gguf_tokenizer(GGUFFile(path).metadata, native_encoder=native_encoder)
    cases = read_cases(path)
    failed = [(text, ids, got) for text, ids in cases
              if (got := tok.encode(text, add_special_tokens=False)) != ids]
    detail = "\n".join(f"  {text[:60]!r}: expected {ids[:12]}, got {got[:12]}"
                       for text, ids, got in failed[:5])
    assert not failed, f"{_name(path)}: {len(cases) - len(failed)}/{len(cases)} cases\n{detail}"


# ---------------------------------------------------------------- vocabularies that must not load

def _bpe_metadata(**overrides) -> dict:
    tokens = ["a", "b", "ab", "Ġ", "<|endoftext|>"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 1, 1, 1, 3],
                "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 4}
    metadata.update(overrides)
    return {k: v for k, v in metadata.items() if v is not None}


def _spm_metadata(**overrides) -> dict:
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "▁a", "b"],
                "tokenizer.ggml.scores": [0.0, -1.0, -2.0],
                "tokenizer.ggml.token_type": [2, 1, 1]}
    metadata.update(overrides)
    return {k: v for k, v in metadata.items() if v is not None}


@pytest.mark.parametrize("native_encoder", ENCODERS, ids=lambda n: "c" if n else "python")
def test_a_well_formed_toy_vocabulary_loads(native_encoder):
    assert load_gguf_tokenizer(_bpe_metadata(), native_encoder).encode("ab", False) == [2]
    assert load_gguf_tokenizer(_spm_metadata(), native_encoder).encode("a", False) == [1]


def test_a_unigram_toy_vocabulary_loads():
    metadata = _spm_metadata(**{"tokenizer.ggml.model": "t5",
                                "tokenizer.ggml.unknown_token_id": 0,
                                "tokenizer.ggml.add_space_prefix": True})
    assert load_gguf_tokenizer(metadata).encode("ab", False) == [1, 2]


def test_unknown_pre_tokenizer_lists_the_known_names():
    with pytest.raises(ModelLoadError, match="no-such-pre") as err:
        load_gguf_tokenizer(_bpe_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}))
    for name in ("llama-bpe", "qwen2", "falcon", "starcoder", "deepseek-llm", "qwen35", "mpt"):
        assert name in str(err.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenizer.ggml.pre", "whitespace", "not implemented"),
    ("tokenizer.ggml.model", "rwkv", "not implemented"),
    ("tokenizer.ggml.model", "no-such-model", "supported: llama"),
])
def test_tokenizers_out_of_scope_say_so(key, value, message):
    with pytest.raises(ModelLoadError, match=message):
        load_gguf_tokenizer(_bpe_metadata(**{key: value}))


@pytest.mark.parametrize("native_encoder", ENCODERS, ids=lambda n: "c" if n else "python")
@pytest.mark.parametrize(("metadata", "message"), [
    (_spm_metadata(**{"tokenizer.ggml.scores": [0.0, -1.0]}), "scores has 2 entries"),
    (_spm_metadata(**{"tokenizer.ggml.scores": None}), "no tokenizer.ggml.scores"),
    (_spm_metadata(**{"tokenizer.ggml.token_type": [1]}), "token_type has 1 entries"),
    (_bpe_metadata(**{"tokenizer.ggml.token_type": [1] * 9}), "token_type has 9 entries"),
    (_bpe_metadata(**{"tokenizer.ggml.eos_token_id": 5}), "eos_token_id=5 is outside"),
    (_spm_metadata(**{"tokenizer.ggml.bos_token_id": -1}), "bos_token_id=-1 is outside"),
    (_bpe_metadata(**{"tokenizer.ggml.merges": None}), "no tokenizer.ggml.merges"),
    (_bpe_metadata(**{"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.merges": None}),
     "no tokenizer.ggml.merges"),
    (_bpe_metadata(**{"tokenizer.ggml.tokens": []}), "no tokenizer.ggml.tokens"),
], ids=["scores-short", "scores-missing", "types-short", "types-long", "eos-out-of-range",
        "bos-negative", "bpe-no-merges", "gemma4-no-merges", "no-tokens"])
def test_corrupt_vocabulary_is_a_clear_load_error(metadata, message, native_encoder):
    with pytest.raises(ModelLoadError, match=message):
        load_gguf_tokenizer(metadata, native_encoder=native_encoder)


# ---------------------------------------------------------------- the pre-tokenizer table

SAMPLE = ("Hello  world's 12345 ca\u0301fe\u0301\n\n  x\t\u00a0y \u4e2d\u6587 \uc548\ub155 "
          "\u0e44\u0e17\u0e22 \U0001f600!! <sentinel:3> IMGIMGABZ 1,000.5 ...\r\n \u3000end  ")


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_cuts_text_into_pieces_of_itself(name):
    pre = PRE_TOKENIZERS[name]
    words = pre.split(SAMPLE)
    assert all(words)
    assert "".join(words) == (SAMPLE.replace(" ", "\u2581") if pre.escape_spaces else SAMPLE)


def test_categories_are_llama_cpps():
    """A category regex sees one class per category: \\p{Lu} is any letter, as in llama.cpp;
    a regex without one sees non-ASCII whitespace as \\v and everything else as itself."""
    gpt4o = PRE_TOKENIZERS["gpt-4o"]
    assert gpt4o.split("HelloWorld") == ["Hello", "World"]
    assert gpt4o.split("éÉ") == ["éÉ"]  # no case outside ASCII
    assert PRE_TOKENIZERS["deepseek-coder"].split("a\u3000b") == ["a", "\u3000b"]
    assert PRE_TOKENIZERS["deepseek-llm"].split("x   ð") == ["x", "  ", " ð"]  # ð: cased
    assert PRE_TOKENIZERS["superbpe"].split("x1234567") == ["x", "1", "234", "567"]
    assert PRE_TOKENIZERS["afmoe"].split("ab1234c") == ["ab", "1", "234", "c"]


# ---------------------------------------------------------------- whitespace around literals

def _vocab(name: str) -> Path | None:
    folder = _folder()
    path = folder / f"ggml-vocab-{name}.gguf" if folder else None
    return path if path is not None and path.is_file() else None


@pytest.mark.skipif(_vocab("phi-3") is None, reason="set KVLAB_LLAMA_VOCABS (phi-3 vocabulary)")
@pytest.mark.parametrize("native_encoder", ENCODERS, ids=lambda n: "c" if n else "python")
def test_phi3_literal_tokens_swallow_the_whitespace_after_them(native_encoder):
    """llama.cpp gives Phi-3's literal tokens (not <s>, <unk>, <|endoftext|>) rstrip."""
    tok = load_gguf_tokenizer(GGUFFile(_vocab("phi-3")).metadata, native_encoder=native_encoder)
    assert tok.encode("<|user|>\nHi<|end|>\n<|assistant|>", False) == [32010, 6324, 32007, 32001]
    assert tok.encode("a [PAD32011]   \n[PAD32030] b", False) == [263, 29871, 32011, 32030, 289]
    assert tok.encode("  <s>  x </s>  y", False) == [1678, 1, 259, 921, 29871, 2, 343]


@pytest.mark.parametrize("native_encoder", ENCODERS, ids=lambda n: "c" if n else "python")
def test_lstrip_and_rstrip_literals(native_encoder):
    metadata = _bpe_metadata(**{"general.name": "Phi3 toy",  # its literals rstrip
                                "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "<|end|>"]})
    tok = load_gguf_tokenizer(metadata, native_encoder=native_encoder)
    assert tok.encode("ab<|end|> \t\nab", False) == [2, 4, 2]
    assert tok.encode("ab<|end|>  ", False) == [2, 4]
    metadata = _bpe_metadata(**{
        "tokenizer.ggml.pre": "jina-v2-es", "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "<mask>"]})
    tok = load_gguf_tokenizer(metadata, native_encoder=native_encoder)
    assert tok.encode("ab \n<mask> ab", False) == [2, 4, 3, 2]  # <mask> takes the space before


# ---------------------------------------------------------------- BOS defaults

@pytest.mark.parametrize(("pre", "model", "add_bos_token", "expected"), [
    ("gpt-2", "gpt2", None, False), ("llama-bpe", "gpt2", None, True),  # llama.cpp's defaults
    ("tekken", "gpt2", None, True), ("llama-bpe", "gpt2", False, False),  # the GGUF decides
    ("gemma4", "gemma4", False, True),  # llama.cpp always adds Gemma 4's BOS
])
def test_add_bos_follows_llama_cpp(pre, model, add_bos_token, expected):
    metadata = _bpe_metadata(**{"tokenizer.ggml.pre": pre, "tokenizer.ggml.model": model,
                                "tokenizer.ggml.bos_token_id": 4,
                                "tokenizer.ggml.add_bos_token": add_bos_token})
    tok = load_gguf_tokenizer(metadata)
    assert tok.add_bos is expected
    assert tok.encode("ab") == ([4, 2] if expected else [2])
