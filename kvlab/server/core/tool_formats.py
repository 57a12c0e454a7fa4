"""How each model family writes tool calls in a reply, and reading them back out.

A chat template that takes `tools` also teaches its model one way to write a call; the
template's own text says which, so the format is chosen from it (`detect_format`), never from
the model's name. Each `CallFormat` knows

    where a call may begin      `markers` anywhere in the reply, or `opens` / `opening`: the
                                reply's first characters (a JSON call, functionary's recipient)
    how to read the calls       `read(text from the call on, tools) -> (calls, text after)`,
                                None when what follows the marker is not a valid call

    qwen          Hermes / Qwen 2.5-3 / Granite 4   <tool_call>{"name", "arguments"}</tool_call>
    qwen3_coder   Qwen3-Coder, Qwen3.5, Nemotron 3  <tool_call><function=f><parameter=p>v
                                                    </parameter></function></tool_call>
    llama         Llama 3.x                         {"name", "parameters"}, <|python_tag|>{...}
    mistral       Mistral, Devstral, Ministral      [TOOL_CALLS][{...}] or [TOOL_CALLS]f[ARGS]{...}
    deepseek_r1   DeepSeek V3 / R1                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>f
                                                    ```json {...}```<｜tool▁call▁end｜>
    deepseek_v3_1 DeepSeek V3.1                     <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
    gpt_oss       gpt-oss (harmony)                 <|channel|>commentary to=functions.f
                                                    <|constrain|>json<|message|>{...}<|call|>
    glm           GLM 4.5+                          <tool_call>f<arg_key>k</arg_key><arg_value>v
                                                    </arg_value></tool_call>
    kimi_k2       Kimi K2                           <|tool_calls_section_begin|><|tool_call_begin|>
                                                    functions.f:0<|tool_call_argument_begin|>{...}
                                                    <|tool_call_end|><|tool_calls_section_end|>
    granite       Granite 3.x                       <|tool_call|>[{...}]
    functools     Phi-4-mini, FireFunction v2       functools[{...}]
    functionary   functionary v3.2                  >>>f\\n{...} (the prompt ends with ">>>")
    functionary_v3_1  functionary v3.1              <function=f>{...}</function>
    gemma4        Gemma 4                           <|tool_call>call:f{k:<|"|>v<|"|>,n:1}<tool_call|>
    minimax_m2    MiniMax-M2                        <minimax:tool_call><invoke name="f"><parameter
                                                    name="k">v</parameter></invoke></minimax:tool_call>
    minimax_m1    MiniMax-M1                        <tool_calls>{"name", "arguments"}</tool_calls>
    deepseek_v3_2 DeepSeek V3.2, V4 (DSML)          <｜DSML｜function_calls><｜DSML｜invoke name="f">
                                                    <｜DSML｜parameter name="k" string="true">v
                                                    </｜DSML｜parameter></｜DSML｜invoke>...
    seed_oss      Seed-OSS                          <seed:tool_call><function=f><parameter=k>v
                                                    </parameter></function></seed:tool_call>
    command_r     Command-R+                        Action: ```json [{"tool_name", "parameters"}]```
    command_r7b   Command-R7B, Command-A            <|START_ACTION|>[{"tool_call_id", "tool_name",
                                                    "parameters"}]<|END_ACTION|>
    lfm2          LFM2                              <|tool_call_start|>[f(k='v', n=1)]<|tool_call_end|>
    generic       templates without tools           a JSON list of {"name", "arguments"}
    other         templates with tools, none above  Hermes, Llama or generic JSON

Parsing is all or nothing: a call that is not valid JSON, names a tool the request does not
have, or has arguments that are not an object leaves the whole reply as text. While a reply
is streamed, `heads` finds each call's name and `json_prefix` the part of its arguments'
canonical JSON that the text so far fixes, so a stream can name calls and grow their
arguments before the reply ends.
Hand-written because each family's format is a few regular expressions over the reply text
(Gemma 4's values and LFM2's Python call lists each get a small reader of their own); the
formats come from the families' chat templates and documentation.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvlab.server.core.tool_grammars import BUILDERS, Builder, Spec

Tools = Mapping[str, dict[str, Any]]  # tool name -> its parameters' JSON schema
# (name, arguments as an object, the id the model wrote or None)
Found = tuple[str, dict[str, Any], str | None]
Reader = Callable[[str, Tools], tuple[list[Found], str] | None]
_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallFormat:
    """One family's way of writing calls: where they begin, how to read them, which of its
    markers are special tokens, and the call ids its template takes back."""

    name: str
    read: Reader
    markers: tuple[str, ...] = ()
    opens: str = ""  # characters that, opening the reply (after whitespace), begin a call
    opening: Callable[[str, Tools], bool | None] | None = None  # overrides `opens`
    lead: str = ""  # written before plain text at the reply's start; not content
    # where each call's name is written, up to its JSON arguments (group 1, or the last group
    # that matched, the name): lets a stream name a call and grow its arguments before the
    # reply ends; None where arguments are not JSON text (XML parameters)
    heads: re.Pattern[str] | None = None
    # the format's markers that vocabularies hold as special tokens, which decoding would
    # otherwise leave out of the text
    tokens: tuple[str, ...] = ()
    # call ids as the template expects them back: openai call_<hex> | mistral 9 alphanumerics
    # | kimi functions.<name>:<index> (as the model wrote it, when it did)
    ids: str = "openai"
    # the grammar that holds a reply to calls in this format (tool_grammars), where the
    # format can spell the tools' arguments; a required call elsewhere is a JSON list
    grammar: Builder | None = None

    def required_grammar(self, tools: Spec, most: int) -> str | None:
        """The grammar of one to `most` calls of `tools` in this format, or None."""
        return None if self.grammar is None else self.grammar(tools, most)

    def opens_call(self, text: str, tools: Tools) -> bool | None:
        """Whether the reply's start begins a call (None: cannot tell yet)."""
        if self.opening is not None:
            return self.opening(text, tools)
        rest = text.lstrip()
        return None if not rest else rest[0] in self.opens

    def marker_at(self, text: str, since: int = 0) -> int | None:
        """Where the first call marker in `text` (from `since` on) begins."""
        found = [at for m in self.markers if (at := text.find(m, since)) >= 0]
        return min(found) if found else None

    def call_start(self, text: str, tools: Tools) -> int | None:
        """Where the first call begins in a reply."""
        if self.opens_call(text, tools):
            return len(text) - len(text.lstrip())
        return self.marker_at(text)

    def call_id(self, name: str, index: int, written: str | None) -> str:
        if self.ids == "kimi":
            return written or f"functions.{name}:{index}"
        if self.ids == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


# ---- shared pieces ----------------------------------------------------------------------------


def _arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as an object (JSON text is read); None when they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _json_call(item: Any, tools: Tools, keys: tuple[str, ...] = ("arguments", "parameters")
               ) -> Found | None:
    """{"name" (Cohere's "tool_name"): ..., "arguments" (or "parameters"): {...}} naming a
    known tool."""
    if not isinstance(item, dict):
        return None
    name = item.get("name", item.get("tool_name"))
    if not isinstance(name, str) or name not in tools:
        return None
    args = next((item[k] for k in keys if k in item), {})
    parsed = _arguments(args)
    written = item.get("id") if isinstance(item.get("id"), str) else None
    return None if parsed is None else (name, parsed, written)


def _json_values(text: str, separators: str = " \t\r\n") -> tuple[list[Any], str]:
    """JSON values one after another (between them only `separators`), and the rest."""
    values, pos = [], 0
    while True:
        at = pos
        while at < len(text) and text[at] in separators:
            at += 1
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            return values, text[pos:]
        values.append(value)
        pos = end


def _json_calls(text: str, tools: Tools, separators: str = " \t\r\n"
                ) -> tuple[list[Found], str] | None:
    """Calls as JSON: objects one after another, or lists of them."""
    values, rest = _json_values(text, separators)
    items = [i for v in values for i in (v if isinstance(v, list) else [v])]
    calls = [_json_call(i, tools) for i in items]
    if not calls or None in calls:
        return None
    return calls, rest  # type: ignore[return-value]


def _repeated(text: str, call: re.Pattern[str], one: Callable[[re.Match[str]], Found | None]
              ) -> tuple[list[Found], str] | None:
    """Calls matched by `call` one after another from the start of `text`, and the rest."""
    calls, pos = [], 0
    while (m := call.match(text, pos)) is not None and m.end() > pos:
        found = one(m)
        if found is None:
            return None
        calls.append(found)
        pos = m.end()
    return (calls, text[pos:]) if calls else None


def _typed(value: str, schema: Any) -> Any:
    """A parameter written as bare text, typed by its JSON schema: strings stay text, other
    types are read as JSON, or as a Python literal (Seed-OSS's template writes them with
    Python's `str`), and stay text when they are neither."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return _literal(ast.parse(value.strip(), mode="eval").body)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return value


def _property(tools: Tools, name: str, key: str) -> Any:
    props = tools.get(name, {}).get("properties")
    return props.get(key) if isinstance(props, dict) else None


# ---- the families -----------------------------------------------------------------------------

_HERMES = re.compile(r"\s*<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _read_hermes(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    def one(m: re.Match[str]) -> Found | None:
        got = _json_calls(m.group(1), tools)
        return got[0][0] if got and len(got[0]) == 1 and not got[1].strip() else None
    return _repeated(text, _HERMES, one)


def _read_llama(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    return _json_calls(text.removeprefix("<|python_tag|>"), tools, " \t\r\n;")


def _read_other(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    return _read_hermes(text, tools) if text.startswith("<tool_call>") \
        else _read_llama(text, tools)


def _coder_call(tag: str) -> re.Pattern[str]:
    """<function=f>...</function> calls, each wrapped in <tag>...</tag> or not."""
    return re.compile(rf"\s*(?:<{tag}>\s*)?<function=([^>\n]+)>(.*?)</function>\s*"
                      rf"(?:</{tag}>)?", re.DOTALL)


_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                          re.DOTALL)


def _xml_functions(tag: str) -> Reader:
    """Qwen3-Coder's calls (in <tool_call>), Seed-OSS's (in <seed:tool_call>)."""
    call = _coder_call(tag)

    def read(text: str, tools: Tools) -> tuple[list[Found], str] | None:
        def one(m: re.Match[str]) -> Found | None:
            name = m.group(1).strip()
            if name not in tools:
                return None
            args = {}
            for p in _CODER_PARAM.finditer(m.group(2)):
                key = p.group(1).strip()
                value = p.group(2).removeprefix("\n").removesuffix("\n")
                args[key] = _typed(value, _property(tools, name, key))
            return name, args, None
        return _repeated(text, call, one)
    return read


_GLM = re.compile(r"\s*<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_value>\s*)*)"
                  r"(?:</tool_call>|$)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _read_glm(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    def one(m: re.Match[str]) -> Found | None:
        name = m.group(1).strip()
        if name not in tools:
            return None
        args = {k.strip(): _typed(v, _property(tools, name, k.strip()))
                for k, v in _GLM_ARG.findall(m.group(2))}
        return name, args, None
    return _repeated(text, _GLM, one)


_MISTRAL_ARGS = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.-]+)"
                           r"(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def _read_mistral(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    body = text.removeprefix("[TOOL_CALLS]")
    if body.lstrip().startswith("["):  # the JSON-list form
        return _json_calls(body, tools)
    return _named_json(text, _MISTRAL_ARGS, tools)


def _named_json(text: str, head: re.Pattern[str], tools: Tools
                ) -> tuple[list[Found], str] | None:
    """Calls written as a `head` (group 1 the name, an optional group 2 the call's id), then
    the arguments as a JSON object, one after another."""
    calls: list[Found] = []
    pos = 0
    while (m := head.match(text, pos)) is not None:
        try:
            args, end = _DECODER.raw_decode(text, m.end())
        except ValueError:
            return None
        parsed = _arguments(args)
        if m.group(1) not in tools or parsed is None:
            return None
        calls.append((m.group(1), parsed, m.group(2) if head.groups > 1 else None))
        pos = end
    return (calls, text[pos:]) if calls else None


_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_R1 = re.compile(r"\s*<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n"
                    r"\s*```(?:json)?\s*(.*?)\s*```\s*(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
_DS_V31 = re.compile(r"\s*<｜tool▁call▁begin｜>\s*([^<\n]+?)\s*<｜tool▁sep｜>\s*(.*?)\s*"
                     r"(?:<｜tool▁call▁end｜>|$)", re.DOTALL)


def _deepseek(call: re.Pattern[str]) -> Reader:
    def read(text: str, tools: Tools) -> tuple[list[Found], str] | None:
        def one(m: re.Match[str]) -> Found | None:
            parsed = _arguments(m.group(2))
            return None if m.group(1) not in tools or parsed is None \
                else (m.group(1), parsed, None)
        got = _repeated(text.removeprefix(_DS_BEGIN), call, one)
        return None if got is None else (got[0], _after(got[1], _DS_END))
    return read


def _after(rest: str, end: str) -> str:
    """The text after a section's closing marker (when the model wrote one)."""
    stripped = rest.lstrip()
    return stripped[len(end):] if stripped.startswith(end) else rest


_HARMONY = re.compile(
    r"\s*(?:<\|start\|>assistant\s*)?(?:<\|channel\|>commentary\s*)?to=functions\.([\w.-]+)\s*"
    r"(?:<\|channel\|>commentary\s*)?(?:<\|constrain\|>\s*)?(?:json\s*)?<\|message\|>(.*?)"
    r"(?:<\|call\|>|$)", re.DOTALL)


def _read_gpt_oss(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    def one(m: re.Match[str]) -> Found | None:
        parsed = _arguments(m.group(2).strip())
        return None if m.group(1) not in tools or parsed is None else (m.group(1), parsed, None)
    return _repeated(text, _HARMONY, one)


_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI = re.compile(r"\s*<\|tool_call_begin\|>\s*((?:functions\.)?([\w.-]+?)(?::\d+)?)\s*"
                   r"<\|tool_call_argument_begin\|>\s*(.*?)\s*(?:<\|tool_call_end\|>|$)",
                   re.DOTALL)


def _read_kimi(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    def one(m: re.Match[str]) -> Found | None:
        parsed = _arguments(m.group(3))
        return None if m.group(2) not in tools or parsed is None \
            else (m.group(2), parsed, m.group(1))
    got = _repeated(text.removeprefix(_KIMI_BEGIN), _KIMI, one)
    return None if got is None else (got[0], _after(got[1], _KIMI_END))


def _prefixed_list(marker: str) -> Reader:
    """A marker, then a JSON list of calls (Granite's <|tool_call|>, functools)."""
    def read(text: str, tools: Tools) -> tuple[list[Found], str] | None:
        body = text.removeprefix(marker)
        return _json_calls(body, tools) if body.lstrip().startswith("[") else None
    return read


_FUNCTIONARY = re.compile(r"(?:>>>)?(?!all\n)([\w.-]+)\n")  # "all": text, not a call


def _read_functionary(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    return _named_json(text, _FUNCTIONARY, tools)


_FUNCTION_TAG = re.compile(r"(?:\s*</function>)?\s*<function=([\w.-]+)>")


def _read_function_tags(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    """functionary v3.1's `<function=name>{...}</function>`, one after another."""
    got = _named_json(text, _FUNCTION_TAG, tools)
    return None if got is None else (got[0], _after(got[1], "</function>"))


def _functionary_opening(text: str, tools: Tools) -> bool | None:
    """The reply (after the prompt's ">>>") opens with a recipient line: a tool name is a call."""
    line, newline, _ = text.partition("\n")
    if newline:
        return line in tools
    return None if len(line) <= 64 and re.fullmatch(r"[\w.-]*", line) else False


# Invoke blocks: MiniMax-M2's <minimax:tool_call>, DeepSeek V3.2's DSML (V4 names the block
# tool_calls); a parameter's `string` attribute says whether its value is text or JSON.
def _invokes(block: str, end: str, prefix: str) -> Reader:
    head = re.compile(rf"\s*{block}\s*")
    invoke = re.compile(rf'\s*<{prefix}invoke name="([^"]+)">(.*?)</{prefix}invoke>\s*',
                        re.DOTALL)
    param = re.compile(rf'<{prefix}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)'
                       rf"</{prefix}parameter>", re.DOTALL)

    def read(text: str, tools: Tools) -> tuple[list[Found], str] | None:
        def one(m: re.Match[str]) -> Found | None:
            name, args = m.group(1), {}
            if name not in tools:
                return None
            for key, is_text, value in param.findall(m.group(2)):
                if is_text == "false":
                    try:
                        args[key] = json.loads(value)
                    except ValueError:
                        return None
                else:
                    args[key] = value if is_text else _typed(value, _property(tools, name, key))
            return name, args, None
        opened = head.match(text)
        got = None if opened is None else _repeated(text[opened.end():], invoke, one)
        return None if got is None else (got[0], _after(got[1], end))
    return read


_MINIMAX_BEGIN, _MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
_DSML = "<｜DSML｜"
_DSML_BLOCK = r"<｜DSML｜(function_calls|tool_calls)>"


def _read_dsml(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    block = re.match(_DSML_BLOCK, text)
    if block is None:
        return None
    return _invokes(_DSML_BLOCK, f"</｜DSML｜{block.group(1)}>", "｜DSML｜")(text, tools)


def _wrapped_json(begin: str, end: str, fence: bool = False) -> Reader:
    """A marker, then JSON calls (a list or objects one after another), then its end marker;
    `fence`: the JSON may sit in a ```json block (Command-R+'s "Action:")."""
    def read(text: str, tools: Tools) -> tuple[list[Found], str] | None:
        body = text.removeprefix(begin)
        opened = re.match(r"\s*```(?:json)?\s*", body) if fence else None
        got = _json_calls(body[opened.end():] if opened else body, tools)
        if got is None:
            return None
        rest = got[1]
        if opened:
            rest = _after(rest, "```")
        return got[0], _after(rest, end) if end else rest
    return read


# Gemma 4: call:f{key:value,...} where strings are <|"|>-quoted and keys are bare
_GEMMA_QUOTE = '<|"|>'
_GEMMA_CALL = re.compile(r"\s*<\|tool_call>call:([\w.-]+)(?=\{)")
_GEMMA_KEY = re.compile(r"\s*([^\s:{}\[\],<]+|<\|\"\|>.*?<\|\"\|>)\s*:", re.DOTALL)
_GEMMA_SCALAR = re.compile(r"\s*(-?[0-9][0-9.eE+-]*|true|false|null)")


def _gemma_value(text: str, pos: int) -> tuple[Any, int]:
    """One Gemma 4 value from `pos`: (value, where it ends); ValueError if there is none."""
    while pos < len(text) and text[pos] in " \n":
        pos += 1
    if text.startswith(_GEMMA_QUOTE, pos):
        end = text.find(_GEMMA_QUOTE, pos + len(_GEMMA_QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[pos + len(_GEMMA_QUOTE):end], end + len(_GEMMA_QUOTE)
    if text.startswith("{", pos) or text.startswith("[", pos):
        return _gemma_collection(text, pos)
    m = _GEMMA_SCALAR.match(text, pos)
    if m is None:
        raise ValueError(f"no value at {pos}")
    return json.loads(m.group(1)), m.end()


def _gemma_collection(text: str, pos: int) -> tuple[Any, int]:
    """An object {k:v,...} or a list [v,...] from `pos` (its opening bracket)."""
    is_object, close = text[pos] == "{", "}" if text[pos] == "{" else "]"
    items: list[tuple[str, Any]] = []
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \n,":
            pos += 1
        if text.startswith(close, pos):
            return (dict(items) if is_object else [v for _, v in items]), pos + 1
        key = ""
        if is_object:
            m = _GEMMA_KEY.match(text, pos)
            if m is None:
                raise ValueError(f"no key at {pos}")
            key, pos = m.group(1).removeprefix(_GEMMA_QUOTE).removesuffix(_GEMMA_QUOTE), m.end()
        value, pos = _gemma_value(text, pos)
        items.append((key, value))
        if not text.startswith((",", close), pos):
            raise ValueError(f"expected , or {close} at {pos}")


def _read_gemma4(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    calls: list[Found] = []
    pos = 0
    while (m := _GEMMA_CALL.match(text, pos)) is not None:
        try:
            args, pos = _gemma_value(text, m.end())
        except ValueError:
            return None
        if m.group(1) not in tools or not isinstance(args, dict):
            return None
        calls.append((m.group(1), args, None))
        pos += len("<tool_call|>") if text.startswith("<tool_call|>", pos) else 0
    return (calls, text[pos:]) if calls else None


# LFM2: a Python list of calls with keyword arguments (values Python or JSON literals)
_LFM2_BEGIN, _LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A Python literal, where true / false / null (JSON's) are literals too."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)
                if k is not None}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def _python_call(node: ast.expr, tools: Tools) -> Found | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
            or node.func.id not in tools or any(k.arg is None for k in node.keywords):
        return None
    try:
        return node.func.id, {str(k.arg): _literal(k.value) for k in node.keywords}, None
    except (ValueError, TypeError, SyntaxError):
        return None


def _read_lfm2(text: str, tools: Tools) -> tuple[list[Found], str] | None:
    body = text.removeprefix(_LFM2_BEGIN)
    end = body.find(_LFM2_END)
    inner, rest = (body[:end], body[end + len(_LFM2_END):]) if end >= 0 else (body, "")
    try:
        tree = ast.parse(inner.strip(), mode="eval").body
    except SyntaxError:
        return None
    found = [_python_call(c, tools) for c in (tree.elts if isinstance(tree, ast.List)
                                               else [tree])]
    return None if not found or None in found else (found, rest)  # type: ignore[return-value]


_HERMES_TOKENS = ("<tool_call>", "</tool_call>")
_DS_TOKENS = (_DS_BEGIN, _DS_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
_OBJECT_HEAD = r'\{\s*"name"\s*:\s*"([\w.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
_HEADS = {
    "json": re.compile(_OBJECT_HEAD),
    "mistral": re.compile(r"\[TOOL_CALLS\]\s*([\w.-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]|"
                          + _OBJECT_HEAD),
    "deepseek_r1": re.compile(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)"
                              r"\s*\n\s*```(?:json)?\s*"),
    "deepseek_v3_1": re.compile(r"<｜tool▁call▁begin｜>\s*([\w.-]+)\s*<｜tool▁sep｜>\s*"),
    "gpt_oss": re.compile(r"to=functions\.([\w.-]+)\s*(?:<\|channel\|>commentary\s*)?"
                          r"(?:<\|constrain\|>\s*)?(?:json\s*)?<\|message\|>"),
    "kimi_k2": re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                          r"<\|tool_call_argument_begin\|>\s*"),
    "functionary": re.compile(r"(?:^|>>>)([\w.-]+)\n"),
    "cohere": re.compile(r'\{\s*(?:"tool_call_id"\s*:\s*"[^"]*"\s*,\s*)?"tool_name"\s*:\s*'
                         r'"([\w.-]+)"\s*,\s*"parameters"\s*:\s*'),
}

FORMATS: dict[str, CallFormat] = {f.name: f for f in (
    CallFormat("generic", _read_llama, opens="[{", heads=_HEADS["json"]),
    CallFormat("other", _read_other, ("<tool_call>", "<|python_tag|>"), opens="[{",
               heads=_HEADS["json"], tokens=(*_HERMES_TOKENS, "<|python_tag|>")),
    CallFormat("qwen", _read_hermes, ("<tool_call>",), heads=_HEADS["json"],
               tokens=_HERMES_TOKENS),
    CallFormat("qwen3_coder", _xml_functions("tool_call"), ("<tool_call>", "<function="),
               tokens=_HERMES_TOKENS),
    CallFormat("seed_oss", _xml_functions("seed:tool_call"), ("<seed:tool_call>",),
               tokens=("<seed:tool_call>", "</seed:tool_call>")),
    CallFormat("minimax_m2", _invokes(_MINIMAX_BEGIN, _MINIMAX_END, ""), (_MINIMAX_BEGIN,),
               tokens=(_MINIMAX_BEGIN, _MINIMAX_END)),
    CallFormat("minimax_m1", _wrapped_json("<tool_calls>", "</tool_calls>"), ("<tool_calls>",),
               heads=_HEADS["json"], tokens=("<tool_calls>", "</tool_calls>")),
    CallFormat("deepseek_v3_2", _read_dsml, (f"{_DSML}function_calls>", f"{_DSML}tool_calls>")),
    CallFormat("gemma4", _read_gemma4, ("<|tool_call>",),
               tokens=("<|tool_call>", "<tool_call|>", _GEMMA_QUOTE)),
    CallFormat("command_r", _wrapped_json("Action:", "", fence=True), ("Action:",),
               heads=_HEADS["cohere"]),
    CallFormat("command_r7b", _wrapped_json("<|START_ACTION|>", "<|END_ACTION|>"),
               ("<|START_ACTION|>",), heads=_HEADS["cohere"],
               tokens=("<|START_ACTION|>", "<|END_ACTION|>")),
    CallFormat("lfm2", _read_lfm2, (_LFM2_BEGIN,), tokens=(_LFM2_BEGIN, _LFM2_END)),
    CallFormat("llama", _read_llama, ("<|python_tag|>",), opens="[{", heads=_HEADS["json"],
               tokens=("<|python_tag|>",)),
    CallFormat("mistral", _read_mistral, ("[TOOL_CALLS]",), ids="mistral",
               heads=_HEADS["mistral"], tokens=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    CallFormat("deepseek_r1", _deepseek(_DS_R1), (_DS_BEGIN, "<｜tool▁call▁begin｜>"),
               heads=_HEADS["deepseek_r1"], tokens=_DS_TOKENS),
    CallFormat("deepseek_v3_1", _deepseek(_DS_V31), (_DS_BEGIN, "<｜tool▁call▁begin｜>"),
               heads=_HEADS["deepseek_v3_1"], tokens=_DS_TOKENS),
    CallFormat("gpt_oss", _read_gpt_oss, ("<|start|>assistant<|channel|>commentary to=",
                                          "<|start|>assistant to=functions.",
                                          "<|channel|>commentary to=functions.",
                                          "to=functions."), heads=_HEADS["gpt_oss"],
               tokens=("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>",
                       "<|call|>")),
    CallFormat("glm", _read_glm, ("<tool_call>",), tokens=(
        *_HERMES_TOKENS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    CallFormat("kimi_k2", _read_kimi, (_KIMI_BEGIN, "<|tool_call_begin|>"), ids="kimi",
               heads=_HEADS["kimi_k2"], tokens=(
                   _KIMI_BEGIN, _KIMI_END, "<|tool_call_begin|>", "<|tool_call_end|>",
                   "<|tool_call_argument_begin|>")),
    CallFormat("granite", _prefixed_list("<|tool_call|>"), ("<|tool_call|>",),
               heads=_HEADS["json"], tokens=("<|tool_call|>",)),
    CallFormat("functools", _prefixed_list("functools"), ("functools[",), heads=_HEADS["json"]),
    CallFormat("functionary_v3_1", _read_function_tags, ("<function=",),
               heads=_FUNCTION_TAG),
    CallFormat("functionary", _read_functionary, (">>>",), opening=_functionary_opening,
               lead="all\n", heads=_HEADS["functionary"]),
)}


FORMATS = {name: replace(f, grammar=BUILDERS.get(name)) for name, f in FORMATS.items()}


def detect_format(template: str | None, takes_tools: bool) -> str:
    """The tool-call format a chat template teaches, from the template's own text.

    A template that does not take `tools` gets the generic form (tools described in a system
    message, calls as a JSON list); one that does but matches no family gets "other"."""
    t = template or ""
    if not takes_tools:
        return "generic"
    rules = (
        ("gemma4", "<|tool_call>call:" in t),
        ("deepseek_v3_2", "｜DSML｜" in t),
        ("minimax_m2", _MINIMAX_BEGIN in t),
        ("seed_oss", "<seed:tool_call>" in t),
        ("command_r7b", "<|START_ACTION|>" in t),
        ("command_r", "Action:" in t and '"tool_name"' in t),
        ("lfm2", _LFM2_BEGIN in t or "<|tool_list_start|>" in t),
        ("minimax_m1", "<tool_calls>" in t and '"arguments"' in t),
        ("gpt_oss", "<|channel|>" in t and "<|call|>" in t),
        ("mistral", "[TOOL_CALLS]" in t),
        ("kimi_k2", _KIMI_BEGIN in t),
        ("deepseek_r1", "tool▁sep" in t and "```json" in t),
        ("deepseek_v3_1", "tool▁sep" in t),
        ("glm", "<arg_key>" in t),
        ("qwen3_coder", "<tool_call>" in t and "<function=" in t and "<parameter=" in t),
        ("qwen", "<tool_call>" in t),
        ("granite", "<|tool_call|>" in t),
        ("functools", "functools[" in t),
        ("functionary", ">>>all" in t),
        ("functionary_v3_1", "<function=" in t and "</function>" in t
         and "<parameter=" not in t),
        ("llama", "<|python_tag|>" in t or ('"parameters"' in t and "<|eot_id|>" in t)),
    )
    return next((name for name, hit in rules if hit), "other")


# ---- arguments while they are written ---------------------------------------------------------

_TOKEN = re.compile(r'\s*(?:([{}\[\]:,])|("(?:[^"\\]|\\.)*")|'
                    r'(-?[0-9][0-9.eE+-]*|true|false|null)(?=[\s,}\]])|("(?:[^"\\]|\\.)*))')
_SEPARATORS = {":": ": ", ",": ", "}


def json_prefix(raw: str) -> str:
    """The part of a JSON object's canonical text (`json.dumps(..., ensure_ascii=False)`, as
    calls' arguments are written) that the written prefix `raw` already fixes: tokens as they
    complete, a string's characters as they come; a number waits for what ends it."""
    out: list[str] = []
    depth, pos = 0, 0
    while pos == 0 or depth:
        m = _TOKEN.match(raw, pos)
        if m is None or (pos == 0 and m.group(1) != "{"):
            break
        punct, string, scalar, partial = m.groups()
        try:
            if punct:
                out.append(_SEPARATORS.get(punct, punct))
                depth += 1 if punct in "{[" else -1 if punct in "}]" else 0
            elif string is not None:
                out.append(json.dumps(json.loads(string), ensure_ascii=False))
            elif scalar is not None:
                out.append(json.dumps(json.loads(scalar)))
            else:
                out.append(_open_string(partial))
                break
        except ValueError:
            break
        pos = m.end()
    return "".join(out)


def _open_string(partial: str) -> str:
    """A string still being written, as far as its characters are certain (an escape cut
    short, or the first half of a surrogate pair, waits)."""
    text = re.sub(r"\\u[0-9a-fA-F]{0,3}$", "", partial)
    decoded = json.loads(text + '"')
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":
        decoded = decoded[:-1]
    return json.dumps(decoded, ensure_ascii=False)[:-1]
