"""Grammars that hold a reply to tool calls written in a family's own format.

When a call is required (`tool_choice` "required" or a named tool), decoding is constrained so
the reply is one or more calls of the request's tools, each one's arguments valid against the
tool's `parameters`, written exactly as the family's template teaches (`tool_formats`): the
model sees its own format in the conversation, and the reply reads back with the family's
reader. Each builder takes the tools as (name, parameters schema) pairs and the most calls
the reply may hold, and returns an llguidance Lark grammar, or None where the format cannot
say the tools' arguments (a parameter-by-parameter format needs each parameter listed).

    JSON arguments          the family's markers around `%json` of the call or the arguments
    parameters as text      one rule per parameter in the schema's order, required ones
                            always, others optional; a string runs to the closing tag, any
                            other type is JSON
    Gemma 4                 <|"|>-quoted strings and bare keys, from the schema
    LFM2                    Python keyword arguments: strings in single quotes, others JSON

Builders write markers as text literals; `with_special_tokens` then writes each marker the
vocabulary holds as one special token as that token (`<[id]>`), since llguidance never
matches a special token by its text and a real model emits the token, not the text's pieces.
A marker inside a `[suffix=...]` (the text a free string runs to) stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from kvlab.structured.compiler import closed_schema

Spec = list[tuple[str, dict[str, Any]]]  # (tool name, its parameters' JSON schema)
Builder = Callable[[Spec, int], str | None]
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Rules:
    """A grammar's rules as they are made: each helper returns the name of a new rule."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.shared: set[str] = set()  # shared rules already added

    def add(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name

    def json(self, schema: Any) -> str:
        """JSON valid against `schema`, spelled as a json_schema structure is (no free
        whitespace, so a model cannot pad a call forever)."""
        held = {**closed_schema(schema), "x-guidance": _JSON_STYLE}
        return self.add(f"%json {json.dumps(held, ensure_ascii=False)}")

    def text_until(self, end: str) -> str:
        """Any text, then `end` (its first occurrence ends it)."""
        return self.add("/(?s:.*)/", f"[suffix={lit(end)}]")

    def gemma_any(self) -> str:
        """Any Gemma 4 value (a parameter whose schema leaves it open), its rules added
        once."""
        if "gany" not in self.shared:
            self.shared.add("gany")
            quote = lit(_GEMMA_QUOTE)
            text = self.text_until(_GEMMA_QUOTE)
            self.lines += [
                (f'gany: {quote} {text} | GNUM | "true" | "false" | "null" | "[" (gany '
                '("," gany)*)? "]" | "{" (GKEY ":" gany ("," GKEY ":" gany)*)? "}"'),
                r"GNUM: /-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
                "GKEY: /[A-Za-z_][A-Za-z0-9_]*/"]
        return "gany"

    def grammar(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.lines, ""])


def repeat(call: str, most: int, sep: str = "") -> str:
    """One to `most` calls, `sep` between them."""
    if most <= 1:
        return call
    return f"{call} ({lit(sep)} {call}){{0,{most - 1}}}" if sep else f"{call}{{1,{most}}}"


def sequence(items: list[tuple[str, bool]], sep: str) -> str:
    """Items in order, each (grammar, required); `sep` between those present."""
    if not items:
        return '""'
    joined = lit(sep) + " " if sep else ""

    def after(rest: list[tuple[str, bool]]) -> str:
        return " ".join(f"({joined}{x})" + ("" if req else "?") for x, req in rest)
    options = []
    for k, (x, req) in enumerate(items):
        options.append(f"{x} {after(items[k + 1:])}".strip())
        if req:
            break
    else:
        options.append('""')
    return "(" + " | ".join(options) + ")"


def is_text(schema: Any) -> bool:
    """Whether a parameter is written as bare text (a string, or a choice of strings)."""
    if not isinstance(schema, dict):
        return False
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string"


def params(schema: dict[str, Any]) -> list[tuple[str, Any, bool]] | None:
    """(name, schema, required) of each parameter; None when they are not listed."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return None if schema.get("additionalProperties", True) is not False else []
    required = set(schema.get("required") or ())
    return [(k, v, k in required) for k, v in props.items()]


def keyword_calls(r: Rules, tools: Spec, param: Callable[[str, Any], str], sep: str
                  ) -> list[tuple[str, str]] | None:
    """(tool name, the grammar of its parameters in order, `sep` between them) per tool,
    `param(key, schema)` giving each one's; None where a tool does not list its parameters."""
    out = []
    for name, schema in tools:
        listed = params(schema)
        if listed is None:
            return None
        items = [(r.add(param(key, sub)), required) for key, sub, required in listed]
        out.append((name, sequence(items, sep)))
    return out


def text_value(r: Rules, schema: Any, end: str) -> str:
    """A parameter's value as text, then `end`: a string's characters, or JSON."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if is_text(schema) and enum:
        return f"({' | '.join(lit(v) for v in enum)}) {lit(end)}"
    if is_text(schema):
        return r.text_until(end)
    return f"{r.json(schema)} {lit(end)}"


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')  # a Lark string literal, as `lit` writes it
_RULE_HEAD = re.compile(r'\w+(\[suffix=' + _LITERAL.pattern + r'\])?: ')  # `r3[suffix="x"]: `


def with_special_tokens(grammar: str, specials: Mapping[str, int]) -> str:
    """The grammar with each special token's text, in its rules' literals, written as the
    token: `"<tool_call>\\n"` -> `(<[151657]> "\\n")`. `%json` bodies and rule attributes
    are left as they are."""
    if not specials:
        return grammar
    split = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
                       + ")")

    def tokens(m: re.Match[str]) -> str:
        pieces = split.split(json.loads(m.group()))
        if len(pieces) == 1:  # no special token's text in it
            return m.group()
        return "(" + " ".join(f"<[{specials[p]}]>" if p in specials else lit(p)
                              for p in pieces if p) + ")"
    lines = []
    for line in grammar.split("\n"):
        head = _RULE_HEAD.match(line)
        if head and not line[head.end():].startswith("%json"):
            line = head.group() + _LITERAL.sub(tokens, line[head.end():])
        lines.append(line)
    return "\n".join(lines)


# ---- the families --------------------------------------------------------------------------


def json_calls(before: str, after: str, args_key: str = "arguments", sep: str = "\n",
               block: tuple[str, str] = ("", ""),
               item: Callable[[Spec], dict[str, Any]] | None = None) -> Builder:
    """Each call as JSON (`item`, by default {name, arguments}) between `before` and `after`;
    all of them in `block`'s markers, `sep` between them."""
    def build(tools: Spec, most: int) -> str:
        r = Rules()
        schema = item(tools) if item else call_schema(tools, args_key)
        call = f"{lit(before)} {r.json(schema)} {lit(after)}"
        return r.grammar(f"{lit(block[0])} {repeat(r.add(call), most, sep)} {lit(block[1])}")
    return build


def json_list(before: str, after: str = "", item: Callable[[Spec], dict[str, Any]] | None = None
              ) -> Builder:
    """A JSON list of calls between `before` and `after`."""
    def build(tools: Spec, most: int) -> str:
        r = Rules()
        schema = {"type": "array", "minItems": 1, "maxItems": most,
                  "items": (item or call_schema)(tools)}
        return r.grammar(f"{lit(before)} {r.json(schema)} {lit(after)}".strip())
    return build


def call_schema(tools: Spec, args_key: str = "arguments") -> dict[str, Any]:
    calls = [{"type": "object", "required": ["name", args_key], "properties": {
        "name": {"const": n}, args_key: p or {"type": "object"}}} for n, p in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def mistral_item(tools: Spec) -> dict[str, Any]:
    """Mistral's {"name", "arguments", "id"}: the id is nine letters or digits."""
    calls = [{"type": "object", "required": ["name", "arguments", "id"], "properties": {
        "name": {"const": n}, "arguments": p or {"type": "object"},
        "id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}} for n, p in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def cohere_item(with_id: bool) -> Callable[[Spec], dict[str, Any]]:
    """Cohere's {"tool_call_id"?, "tool_name", "parameters"} call."""
    def item(tools: Spec) -> dict[str, Any]:
        calls = [{"type": "object", "required": [*(["tool_call_id"] if with_id else []),
                                                  "tool_name", "parameters"],
                  "properties": {**({"tool_call_id": {"type": "string", "pattern": "^[0-9]$"}}
                                    if with_id else {}),
                                 "tool_name": {"const": n},
                                 "parameters": p or {"type": "object"}}} for n, p in tools]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}
    return item


def named_json(head: Callable[[str], str], tail: str, before: str = "", after: str = "",
               sep: str = "") -> Builder:
    """Each call as `head(name)` (grammar text), its arguments as JSON, then `tail`; all of
    them between `before` and `after`."""
    def build(tools: Spec, most: int) -> str:
        r = Rules()
        calls = [f"{head(n)} {r.json(p or {'type': 'object'})} {lit(tail)}" for n, p in tools]
        call = r.add(" | ".join(calls))
        return r.grammar(f"{lit(before)} {repeat(call, most, sep)} {lit(after)}")
    return build


def xml_params(head: Callable[[str], str], param: Callable[[str, Any], tuple[str, str]],
               tail: str, before: str = "", after: str = "", sep: str = "") -> Builder:
    """Each call as `head(name)`, its parameters one by one (`param(key, schema)` gives the
    text before the value and the end after it), then `tail`; `sep` between calls."""
    def build(tools: Spec, most: int) -> str | None:
        r = Rules()

        def one(key: str, sub: Any) -> str:
            opening, end = param(key, sub)
            return f"{lit(opening)} {text_value(r, sub, end)}"
        listed = keyword_calls(r, tools, one, "")
        if listed is None:
            return None
        call = r.add(" | ".join(f"{lit(head(n))} {args} {lit(tail)}" for n, args in listed))
        return r.grammar(f"{lit(before)} {repeat(call, most, sep)} {lit(after)}")
    return build


_GEMMA_QUOTE = '<|"|>'


def gemma_value(r: Rules, schema: Any) -> str | None:
    """A value as Gemma 4 writes call arguments; None for a schema it cannot spell out."""
    if not isinstance(schema, dict):
        return None
    kind, enum = schema.get("type"), schema.get("enum")
    if is_text(schema) and enum:
        return "(" + " | ".join(lit(_GEMMA_QUOTE + v + _GEMMA_QUOTE) for v in enum) + ")"
    if is_text(schema):
        return f"{lit(_GEMMA_QUOTE)} {r.text_until(_GEMMA_QUOTE)}"
    if kind in ("integer", "number", "boolean", "null"):
        return r.json(schema)
    if kind == "array" and isinstance(schema.get("items"), dict):
        item = gemma_value(r, schema["items"])
        return None if item is None else f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object" and params(schema) is None or not schema or kind == "array":
        return r.gemma_any()
    if kind == "object" or "properties" in schema:
        return gemma_object(r, schema)
    return None


def gemma_object(r: Rules, schema: dict[str, Any]) -> str | None:
    listed = params(schema)
    if listed is None:
        return None
    items = []
    for key, sub, required in sorted(listed, key=lambda p: p[0]):  # the template dictsorts
        value = gemma_value(r, sub)
        if value is None:
            return None
        items.append((r.add(f"{lit(key + ':')} {value}"), required))
    return f'"{{" {sequence(items, ",")} "}}"'


def gemma4(tools: Spec, most: int) -> str | None:
    r = Rules()
    calls = []
    for name, schema in tools:
        args = gemma_object(r, schema or {"type": "object", "additionalProperties": False})
        if args is None:
            return None
        calls.append(f"{lit('<|tool_call>call:' + name)} {args} {lit('<tool_call|>')}")
    return r.grammar(repeat(r.add(" | ".join(calls)), most))


def python_value(r: Rules, schema: Any) -> str:
    """A keyword argument's value as LFM2's template writes it: a string in single quotes,
    anything else as JSON (which Python reads, true / false / null aside, which the reader
    takes too)."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if is_text(schema) and enum:
        return "(" + " | ".join(lit(f"'{v}'") for v in enum) + ")"
    return f'"\'" {r.text_until(chr(39))}' if is_text(schema) else r.json(schema)


def lfm2(tools: Spec, most: int) -> str | None:
    """[f(k=v, ...), ...] with Python keyword arguments."""
    r = Rules()
    listed = keyword_calls(r, tools, lambda k, sub: f"{lit(k + '=')} {python_value(r, sub)}",
                           ", ")
    if listed is None:
        return None
    call = r.add(" | ".join(f'{lit(n + "(")} {args} ")"' for n, args in listed))
    return r.grammar(f'"<|tool_call_start|>[" {repeat(call, most, ", ")} "]<|tool_call_end|>"')


def dsml_param(key: str, schema: Any) -> tuple[str, str]:
    kind = "true" if is_text(schema) else "false"
    return f'<｜DSML｜parameter name="{key}" string="{kind}">', "</｜DSML｜parameter>\n"


_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

BUILDERS: dict[str, Builder] = {
    "qwen": json_calls("<tool_call>\n", "\n</tool_call>"),
    "llama": json_calls("", "", "parameters"),
    "mistral": json_list("[TOOL_CALLS]", item=mistral_item),
    "granite": json_list("<|tool_call|>"),
    "functools": json_list("functools"),
    "minimax_m1": json_calls("", "", block=("<tool_calls>\n", "\n</tool_calls>")),
    "command_r": json_list("Action:\n```json\n", "\n```", cohere_item(False)),
    "command_r7b": json_calls("", "", sep=",\n    ", item=cohere_item(True),
                              block=("<|START_ACTION|>[\n    ", "\n]<|END_ACTION|>")),
    "deepseek_r1": named_json(
        lambda n: lit(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n"),
        "\n```<｜tool▁call▁end｜>", *_DS),
    "deepseek_v3_1": named_json(lambda n: lit(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>"),
                                "<｜tool▁call▁end｜>", *_DS),
    # the call's index after its name (functions.f:0), which its id keeps
    "kimi_k2": named_json(lambda n: f"{lit(f'<|tool_call_begin|>functions.{n}:')} /[0-9]/ "
                                    f"{lit('<|tool_call_argument_begin|>')}",
                          "<|tool_call_end|>", "<|tool_calls_section_begin|>",
                          "<|tool_calls_section_end|>"),
    "functionary_v3_1": named_json(lambda n: lit(f"<function={n}>"), "</function>"),
    "functionary": named_json(lambda n: lit(f"{n}\n"), "", sep=">>>"),
    "qwen3_coder": xml_params(lambda n: f"<tool_call>\n<function={n}>\n",
                              lambda k, s: (f"<parameter={k}>\n", "\n</parameter>\n"),
                              "</function>\n</tool_call>", sep="\n"),
    "seed_oss": xml_params(lambda n: f"<seed:tool_call>\n<function={n}>\n",
                           lambda k, s: (f"<parameter={k}>", "</parameter>\n"),
                           "</function>\n</seed:tool_call>", sep="\n"),
    "glm": xml_params(lambda n: f"<tool_call>{n}\n",
                      lambda k, s: (f"<arg_key>{k}</arg_key>\n<arg_value>", "</arg_value>\n"),
                      "</tool_call>", sep="\n"),
    "minimax_m2": xml_params(lambda n: f'<invoke name="{n}">\n',
                             lambda k, s: (f'<parameter name="{k}">', "</parameter>\n"),
                             "</invoke>\n", "<minimax:tool_call>\n", "</minimax:tool_call>"),
    "deepseek_v3_2": xml_params(lambda n: f'<｜DSML｜invoke name="{n}">\n', dsml_param,
                                "</｜DSML｜invoke>\n", "<｜DSML｜function_calls>\n",
                                "</｜DSML｜function_calls>"),
    "gemma4": gemma4,
    "lfm2": lfm2,
}
