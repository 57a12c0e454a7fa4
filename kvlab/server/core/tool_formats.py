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
    generic       templates without tools           a JSON list of {"name", "arguments"}
    other         templates with tools, none above  Hermes, Llama or generic JSON

Parsing is all or nothing: a call that is not valid JSON, names a tool the request does not
have, or has arguments that are not an object leaves the whole reply as text. While a reply
is streamed, `heads` finds each call's name and `json_prefix` the part of its arguments'
canonical JSON that the text so far fixes, so a stream can name calls and grow their
arguments before the reply ends.
Hand-written because each family's format is a few regular expressions over the reply text;
the formats come from the families' chat templates and documentation.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
    """{"name": ..., "arguments" (or "parameters"): {...}} naming a known tool."""
    if not isinstance(item, dict) or item.get("name") not in tools:
        return None
    args = next((item[k] for k in keys if k in item), {})
    parsed = _arguments(args)
    written = item.get("id") if isinstance(item.get("id"), str) else None
    return None if parsed is None else (item["name"], parsed, written)


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
    types are read as JSON (and stay text when they are not valid JSON)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except ValueError:
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


_CODER = re.compile(r"\s*(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>\s*"
                    r"(?:</tool_call>)?", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                          re.DOTALL)


def _read_qwen3_coder(text: str, tools: Tools) -> tuple[list[Found], str] | None:
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
    return _repeated(text, _CODER, one)


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
}

FORMATS: dict[str, CallFormat] = {f.name: f for f in (
    CallFormat("generic", _read_llama, opens="[{", heads=_HEADS["json"]),
    CallFormat("other", _read_other, ("<tool_call>", "<|python_tag|>"), opens="[{",
               heads=_HEADS["json"], tokens=(*_HERMES_TOKENS, "<|python_tag|>")),
    CallFormat("qwen", _read_hermes, ("<tool_call>",), heads=_HEADS["json"],
               tokens=_HERMES_TOKENS),
    CallFormat("qwen3_coder", _read_qwen3_coder, ("<tool_call>", "<function="),
               tokens=_HERMES_TOKENS),
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


def detect_format(template: str | None, takes_tools: bool) -> str:
    """The tool-call format a chat template teaches, from the template's own text.

    A template that does not take `tools` gets the generic form (tools described in a system
    message, calls as a JSON list); one that does but matches no family gets "other"."""
    t = template or ""
    if not takes_tools:
        return "generic"
    rules = (
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
