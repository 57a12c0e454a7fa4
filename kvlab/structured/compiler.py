"""Structure -> llguidance grammar -> a validated template matcher, cached by its text.

Compiling runs on one worker thread (llguidance releases the GIL), so the engine thread only
ever picks up finished templates. The first compile also builds the vocabulary tables (~1 s
for 262k tokens). A bad structure fails with a RequestError naming what is wrong, in
llguidance's words ("Unimplemented keys: [\"not\"]", "unclosed group", ...).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from kvlab.errors import RequestError
from kvlab.request import Structure
from kvlab.structured.vocab import ll_tokenizer
from kvlab.tokenizer import Tokenizer

Template = llguidance.LLMatcher  # a compiled structure in its start state; deep_copy() per use
# One canonical JSON spelling (", " and ": ", no free whitespace): the model cannot pad its
# output with spaces, and fixed keys become forced tokens.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED = 256  # compiled structures kept; the least recently used is dropped
_GBNF_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)  # else the grammar is Lark


def grammar_text(structure: Structure) -> str:
    """The llguidance grammar of a structure; RequestError if its text is malformed."""
    kind, value = structure.kind, structure.value
    if kind == "json_object":
        value, kind = '{"type": "object"}', "json_schema"
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("a JSON schema must be an object (or true / false)")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed_schema(schema)),
                                                             overrides=_JSON_STYLE)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return _choice(value)
    syntax = "gbnf" if _GBNF_ROOT.search(value) else "lark"
    try:
        return llguidance.grammar_from(syntax, value)
    except ValueError as e:
        raise RequestError(f"the grammar does not parse: {e}") from None


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: object) -> object:
    """Objects that list their properties and say nothing of others allow no others.

    JSON Schema's default lets any extra key in, and a small model then writes keys forever;
    vLLM's default backend (xgrammar, strict mode) closes such objects the same way. Only
    subschema positions are visited, so a property named "properties" stays a property.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = closed_schema(out[key])
    if "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _choice(value: str) -> str:
    try:
        choices = json.loads(value)
    except ValueError:
        choices = None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise RequestError("a choice must be a non-empty list of non-empty strings")
    return llguidance.grammar_from("choice", json.dumps(choices))


class GrammarCompiler:
    """Compiles structures for one model's vocabulary, off the caller's thread."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self._tokenizer, self._n_vocab = tokenizer, n_vocab
        self._vocab: llguidance.LLTokenizer | None = None
        self.whitespace: frozenset[int] = frozenset()  # whitespace-only tokens, with _vocab
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlab-grammar")
        self._cache: OrderedDict[Structure, Future[Template]] = OrderedDict()
        self._lock = threading.Lock()  # submit() is called from the server's threads too

    def submit(self, structure: Structure) -> Future[Template]:
        """The template's future; a structure seen before returns the same future."""
        with self._lock:
            fut = self._cache.get(structure)
            if fut is None:
                fut = self._cache[structure] = self._pool.submit(self._compile, structure)
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(structure)
            return fut

    def compile(self, structure: Structure) -> Template:
        """Block until compiled; raises RequestError for a structure that cannot be used."""
        return self.submit(structure).result()

    def _compile(self, structure: Structure) -> Template:
        if self._vocab is None:
            self._vocab, self.whitespace = ll_tokenizer(self._tokenizer, self._n_vocab)
        try:
            grammar = grammar_text(structure)
        except (ValueError, RuntimeError) as e:  # llguidance's own parse errors
            raise RequestError(f"the {structure.kind.replace('_', ' ')} cannot be used: "
                               f"{_first_line([str(e)])}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._vocab)
        if failed:
            raise RequestError(f"the {structure.kind.replace('_', ' ')} cannot be used: "
                               f"{_first_line(messages)}")
        template = llguidance.LLMatcher(self._vocab, grammar, log_level=0)
        if template.is_error():
            raise RequestError(f"the {structure.kind.replace('_', ' ')} cannot be used: "
                               f"{_first_line([template.get_error()])}")
        return template


def _first_line(messages: list[str]) -> str:
    """The compiler's first message as one line (regex errors span several)."""
    text = " ".join((messages[0] if messages else "rejected by the compiler").split())
    return text if len(text) <= 400 else text[:397] + "..."
