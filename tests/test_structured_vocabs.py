"""Structured outputs on real vocabularies of other tokenizer kinds (llama.cpp's models folder,
`KVLAB_LLAMA_VOCABS`): a schema's forced text is spelled as a reply's continuation, so a
SentencePiece vocabulary's space prefix never reaches the grammar, and a tiny random model
held by the schema writes one whole, valid JSON object.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from test_tool_formats_e2e import tiny_gguf

from kvlab.llm import LLM
from kvlab.request import SamplingParams, Structure
from kvlab.structured import StructuredOutputs, Template
from kvlab.tokenizer.from_gguf import load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

SCHEMA = {"type": "object", "required": ["city", "days", "note"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "note": {"type": "string", "maxLength": 12}}}
VOCABS = ["llama-spm", "phi-3", "qwen2", "llama-bpe"]  # SentencePiece ones first


def _vocab(name: str) -> Path:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    path = Path(folder or "") / f"ggml-vocab-{name}.gguf"
    if not folder or not path.is_file():
        pytest.skip(f"set KVLAB_LLAMA_VOCABS to llama.cpp's models/ folder (with {path.name})")
    return path


def random_walk(outputs: StructuredOutputs, template: Template, vocab_size: int,
                rng: random.Random, limit: int = 200) -> list[int]:
    """One output the structure allows: its forced tokens, and a random allowed token where
    it leaves a choice, until it is complete."""
    seq, ids = "walk", []
    outputs.start(seq, template)
    while not outputs.finished(seq) and len(ids) < limit:
        forced = outputs.forced(seq, 64)
        ids += forced
        if forced or outputs.finished(seq):
            continue
        row = outputs.bitmask([seq], [False])[0].numpy().view(np.uint8)
        allowed = np.flatnonzero(np.unpackbits(row, bitorder="little")[:vocab_size])
        token = int(rng.choice(allowed))
        assert outputs.accept(seq, token)
        ids.append(token)
    assert outputs.finished(seq), "the structure did not complete"
    outputs.release(seq)
    return ids


@pytest.mark.parametrize("name", VOCABS)
def test_forced_text_is_a_continuation(name: str) -> None:
    """Random walks through the schema's allowed tokens end in a complete valid object."""
    tokenizer = load_gguf_tokenizer(GGUFFile(_vocab(name)).metadata)
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size)
    template = outputs.compiler.compile(Structure("json_schema", json.dumps(SCHEMA)))
    rng = random.Random(0)
    for _ in range(3):
        ids = random_walk(outputs, template, tokenizer.vocab_size, rng)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text.startswith('{"city": "'), text


def test_a_tiny_sentencepiece_model_writes_the_whole_object(tmp_path: Path) -> None:
    llm = LLM(str(tiny_gguf(_vocab("llama-spm"), tmp_path / "spm.gguf")))
    params = SamplingParams(max_tokens=80, temperature=0,
                            structured=Structure("json_schema", json.dumps(SCHEMA)))
    out = llm.generate(["The weather as JSON:"], params)[0]
    assert out.finish_reason.value == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("name", ["qwen2", "llama-spm"])
def test_a_special_tokens_text_is_forced_as_text(name: str) -> None:
    """A schema's constant holding a special token's text is written in text pieces, never
    as the special token (which no grammar string allows)."""
    tokenizer = load_gguf_tokenizer(GGUFFile(_vocab(name)).metadata)
    marker = tokenizer.decode([tokenizer.eos_ids[0]], skip_special_tokens=False)
    schema = {"type": "object", "required": ["end"],
              "properties": {"end": {"const": f"a{marker}b"}}}
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size)
    template = outputs.compiler.compile(Structure("json_schema", json.dumps(schema)))
    ids = random_walk(outputs, template, tokenizer.vocab_size, random.Random(0))
    assert not any(tokenizer.is_special(i) for i in ids)
    assert json.loads(tokenizer.decode(ids, skip_special_tokens=False)) == {"end": f"a{marker}b"}
