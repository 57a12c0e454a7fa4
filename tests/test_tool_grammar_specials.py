"""Tool-call markers a vocabulary holds as special tokens are written as those tokens.

Qwen 2.5's vocabulary holds `<tool_call>` and `</tool_call>` as single tokens; here they are
control tokens of llama.cpp's Qwen2 vocabulary (`KVLAB_LLAMA_VOCABS`), in two of its padding
rows. llguidance never matches a special token by its text, so a grammar that wrote the
markers as text would hold a real model, which emits the marker's token, to spelling it in
pieces; the required call's grammar must take the token itself, and the reply reads back.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from test_structured_vocabs import random_walk

from kvlab.request import Structure
from kvlab.server.core.serving import special_markers
from kvlab.server.core.tool_formats import FORMATS
from kvlab.server.core.tool_grammars import with_special_tokens
from kvlab.server.core.tools import parse_reply, tool_plan
from kvlab.structured import StructuredOutputs
from kvlab.tokenizer.from_gguf import load_gguf_tokenizer
from kvlab.weights.gguf_file import GGUFFile

CONTROL = 3  # GGUF token type
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    path = Path(folder or "") / "ggml-vocab-qwen2.gguf"
    if not folder or not path.is_file():
        pytest.skip("set KVLAB_LLAMA_VOCABS to llama.cpp's models/ folder (ggml-vocab-qwen2)")
    metadata = dict(GGUFFile(path).metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata["tokenizer.ggml.token_type"])
    for i, marker in ((151906, "<tool_call>"), (151907, "</tool_call>")):
        tokens[i], types[i] = marker, CONTROL
    metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"] = tokens, types
    return load_gguf_tokenizer(metadata)


def test_markers_become_tokens_and_the_rest_stays_text() -> None:
    specials = {"<tool_call>": 7, "</tool_call>": 8}
    grammar = ('start: r1\nr0[suffix="<tool_call>"]: /(?s:.*)/\nr1: "<tool_call>\\n" r0 '
               '"x\\"<tool_call>y" "plain"\nr2: %json {"const": "<tool_call>"}')
    assert with_special_tokens(grammar, specials).split("\n") == [
        "start: r1", 'r0[suffix="<tool_call>"]: /(?s:.*)/',
        'r1: (<[7]> "\\n") r0 ("x\\"" <[7]> "y") "plain"', 'r2: %json {"const": "<tool_call>"}']
    assert with_special_tokens(grammar, {}) == grammar


def test_a_required_call_takes_the_marker_tokens(tokenizer) -> None:
    specials = special_markers(tokenizer, FORMATS["qwen"].tokens)
    begin, end = specials["<tool_call>"], specials["</tool_call>"]
    plan = tool_plan([WEATHER], "required", None, "qwen", specials)
    structure = plan.structure("qwen")
    assert structure is not None and structure.kind == "grammar"
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size)
    template = outputs.compiler.compile(Structure("grammar", structure.value))
    rng = random.Random(0)
    for _ in range(3):
        ids = random_walk(outputs, template, tokenizer.vocab_size, rng)
        assert ids[0] == begin and ids[-1] == end, ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = parse_reply(text, plan)
        assert not (content or "").strip() and len(calls) == 1, text
        args = json.loads(calls[0]["function"]["arguments"])
        assert calls[0]["function"]["name"] == "get_weather" and args["city"] in ("Paris", "Lima")
