"""OpenAI tool calling on top of the chat template and structured outputs.

    tools + tool_choice ──> ToolPlan: which tools, in which mode
      "none"      the tools are not shown to the model
      "auto"      shown; calls the model writes in its family's format (tool_formats: the
                  format the chat template teaches, which the plan carries) are parsed out
                  of the reply; in the generic, Qwen and Llama 3.1 forms a call is
                  constrained from its first token
      "required"  shown; decoding is constrained to calls (one call when
      named         parallel_tool_calls is false, or the named tool; else at most one per
                  tool), each one's arguments validating against that tool's `parameters`,
                  so any model returns a call: written in the template's own format where
                  it has a grammar for them (tool_grammars), else as a JSON list

A template that uses `tools` (Qwen, Llama 3.1, ...) gets them as transformers passes them;
for one that does not (the default Gemma model's), the tools are described in a system
message in a generic form: the list of function specs, and the JSON to reply with.
Assistant messages with `tool_calls` and `role: "tool"` results are rendered the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvlab.request import Structure
from kvlab.server.core.errors import ApiError
from kvlab.server.core.tool_formats import FORMATS, CallFormat, Found, json_prefix
from kvlab.server.core.tool_grammars import with_special_tokens
from kvlab.structured.compiler import closed_schema

GENERIC_PROMPT = (
    "You can call these tools (JSON function specs):\n{specs}\n\n{how}")
_HOW = {
    "auto": 'To call tools, reply with only a JSON list of calls, each '
            '{"name": <tool name>, "arguments": <object>}; otherwise answer normally.',
    "required": 'Reply with only a JSON list of calls, each {"name": <tool name>, '
                '"arguments": <object>}.',
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The OpenAI function spec, as chat templates receive it."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]
    mode: str  # auto | required (named: required with one tool)
    parallel: bool = True
    form: str = "other"  # the template's tool-call format (tool_formats.FORMATS)
    # the vocabulary's special tokens (text -> id): markers grammars write as the token
    specials: Mapping[str, int] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        return {t.name: t.parameters for t in self.tools}

    @property
    def call_format(self) -> CallFormat:
        """How replies are read: the template's format; in required mode a JSON list where
        that format has no grammar for these tools."""
        if self.mode == "required" and self.native_grammar is None:
            return FORMATS["generic"]
        return FORMATS[self.form]

    @cached_property
    def native_grammar(self) -> str | None:
        """In required mode, the grammar of this plan's calls in the template's own format
        (None where the format cannot say them)."""
        if self.mode != "required":
            return None
        most = len(self.tools) if self.parallel else 1
        grammar = FORMATS[self.form].required_grammar(
            [(t.name, t.parameters) for t in self.tools], most)
        return None if grammar is None else with_special_tokens(grammar, self.specials)

    def call_id(self, name: str, index: int, written: str | None = None) -> str:
        """A call's id as the template takes it back (in required mode too)."""
        return FORMATS[self.form].call_id(name, index, written)

    def call_schema(self, arguments: str = "arguments") -> dict[str, Any]:
        """One call: a tool's name and arguments valid against its parameters (Llama 3.1
        names the arguments "parameters")."""
        calls = [{"type": "object", "required": ["name", arguments], "properties": {
            "name": {"const": t.name}, arguments: t.parameters or {"type": "object"}}}
            for t in self.tools]
        return closed_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def calls_schema(self) -> dict[str, Any]:
        """A JSON list of calls; parallel: at most one per tool, so a model that repeats
        itself still ends."""
        most = len(self.tools) if self.parallel else 1
        return {"type": "array", "items": self.call_schema(), "minItems": 1, "maxItems": most}

    def structure(self, form: str) -> Structure | None:
        """What decoding enforces, by the template's tool format ("generic", "qwen",
        "llama" or "other"). Required: a list of calls. Auto: free text, but a call is
        constrained from its first token: in the generic form a reply that opens with "["
        must be a valid list of calls, in Llama 3.1's one that opens with "{" a valid call;
        in Qwen's, whatever follows `<tool_call>` must be a valid call and `</tool_call>`.
        Auto with another native format is parsed only."""
        if self.mode == "required":
            native = self.native_grammar
            return Structure("json_schema", json.dumps(self.calls_schema())) \
                if native is None else Structure("grammar", native)
        if form == "generic":
            return _json_or_text(self.calls_schema(), "[")
        if form == "llama":
            return _json_or_text(self.call_schema("parameters"), "{")
        if form == "qwen":
            repeat = "*" if self.parallel else "?"
            return Structure("grammar", "\n".join([
                f"start: (pre call){repeat} TAIL",
                'pre[suffix="<tool_call>"]: /(?s:.*)/',
                "TAIL: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
                'call: WS? body WS? "</tool_call>"',
                f"body: %json {json.dumps(self.call_schema())}",
                "WS: /[ \\n]+/", ""]))
        return None


def tool_structure(plan: ToolPlan | None, form: str) -> tuple[Structure, str] | None:
    """(what decoding enforces for the plan's calls, the field it comes from), as
    `Serving.prepared` takes it; None when nothing is enforced."""
    structure = None if plan is None else plan.structure(form)
    return None if structure is None else (structure, "tools")


def _json_or_text(schema: dict[str, Any], opener: str) -> Structure:
    """A reply that is JSON valid against `schema`, or text that does not open with `opener`."""
    return Structure("grammar", f"start: calls | TEXT\ncalls: %json {json.dumps(schema)}\n"
                                f"TEXT: /\\s*[^\\{opener}\\s](.|\\n)*/\n")


def tool_plan(tools: Any, tool_choice: Any, parallel: bool | None, form: str = "other",
              specials: Mapping[str, int] | None = None) -> ToolPlan | None:
    """The plan for a request's tools; None when no tool may be called. `form`: the served
    template's tool-call format (`Serving.tool_form`), which replies are read in;
    `specials`: the format's markers held as special tokens (`Serving.marker_tokens`)."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice names a tool call, but the request has no tools",
                           param="tool_choice")
        return None
    parsed = [_tool(t, i) for i, t in enumerate(_list_of(tools))]
    mode, name = _choice(tool_choice)
    if mode == "none":
        return None
    if name is not None:
        chosen = [t for t in parsed if t.name == name]
        if not chosen:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in "
                                f"tools ({', '.join(t.name for t in parsed)})",
                           param="tool_choice")
        return ToolPlan(chosen, "required", parallel=False, form=form, specials=specials or {})
    return ToolPlan(parsed, mode, parallel=parallel is not False, form=form,
                    specials=specials or {})


def _list_of(tools: Any) -> list[Any]:
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools must be a non-empty list of function tools", param="tools")
    return tools


def _tool(raw: Any, i: int) -> Tool:
    where = f"tools.{i}"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" \
            or not isinstance(raw.get("function"), dict):
        raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       param=where)
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, _ . or -, "
                            f"got {name!r}", param=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object",
                       param=f"{where}.function.parameters")
    description = fn.get("description") or ""
    return Tool(name, description if isinstance(description, str) else "", params)


def _choice(tool_choice: Any) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
        return "required", tool_choice["function"]["name"]
    raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                   param="tool_choice")


# ---- rendering --------------------------------------------------------------------------------


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None,
                      native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the chat template.

    native: the template itself uses `tools`; otherwise calls, results and the tool list are
    written into plain messages (generic form).
    """
    if native:
        specs = [t.spec() for t in plan.tools] if plan else None
        return [_native_message(m) for m in messages], ({"tools": specs} if specs else {})
    out = [_generic_message(m) for m in messages]
    if plan is not None:
        specs = json.dumps([t.spec()["function"] for t in plan.tools], ensure_ascii=False)
        note = GENERIC_PROMPT.format(specs=specs, how=_HOW[plan.mode])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return _merge_turns(out), {}


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    """Tool calls with their arguments as objects, as HF templates expect them."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        return m
    fixed = []
    for call in calls:
        fn = dict(call.get("function", {})) if isinstance(call, dict) else {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        fixed.append({**call, "function": fn} if isinstance(call, dict) else call)
    return {**m, "tool_calls": fixed}


def _generic_message(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        name = m.get("name") or m.get("tool_call_id") or "tool"
        return {"role": "user", "content": f"Result of {name}: {m.get('content', '')}"}
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and isinstance(calls, list) and calls:
        written = [{"name": c.get("function", {}).get("name"),
                    "arguments": _arguments(c.get("function", {}).get("arguments"))}
                   for c in calls if isinstance(c, dict)]
        text = (m.get("content") or "") + json.dumps(written, ensure_ascii=False)
        return {"role": "assistant", "content": text}
    return {"role": m["role"], "content": m.get("content") or ""}


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _merge_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent messages of one role become one (tool results next to a user turn)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] != "system":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


# ---- parsing replies ----------------------------------------------------------------------------


def parse_reply(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished reply, read in the plan's format (in required
    mode the reply is the generic JSON list). With calls, the content is the text before the
    first call (its trailing whitespace dropped) and any text after them; without, the reply
    (less the format's lead, functionary's "all" recipient)."""
    fmt = plan.call_format
    body = _after_lead(text, fmt.lead)
    start = fmt.call_start(body, plan.schemas)
    read = None if start is None else fmt.read(body[start:], plan.schemas)
    if not read:
        return body, []
    found, tail = read
    content, after = body[:start].rstrip(), tail.strip()
    if after:
        content = f"{content}\n{after}" if content else after
    return content or None, [_openai_call(plan, i, f) for i, f in enumerate(found)]


def _after_lead(text: str, lead: str) -> str:
    return text[len(lead):] if lead and text.startswith(lead) else text


def _openai_call(plan: ToolPlan, index: int, found: Found) -> dict[str, Any]:
    name, arguments, written = found
    return {"id": plan.call_id(name, index, written), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


@dataclass
class ToolStream:
    """Streams a reply's text until it may be a tool call, then holds the rest to parse.

    In required mode everything is held (the reply is the JSON of the calls). In auto mode
    text streams until a call could begin (a marker, or a part of one at the end, or a
    reply that opens like a call); trailing whitespace waits for what follows, since it is
    dropped before a call. What was sent is always the start of what `parse_reply` gives
    for the whole reply, and `finish` sends the remainder, so the streamed text and calls
    equal the whole reply's parse.
    """

    plan: ToolPlan
    text: str = ""  # the reply so far (its lead, once complete, removed)
    sent: int = 0  # characters of `text` already sent
    holding: bool = False  # a call has begun: hold everything from here
    lead_done: bool = False
    opened: bool | None = None  # whether the reply opens with a call (None: not known yet)

    @property
    def held(self) -> str:
        """The reply's text not sent yet, as written (calls and all)."""
        return self.text[self.sent:]

    def feed(self, delta: str) -> str:
        """The part of the reply that can be sent now."""
        self.text += delta
        if self.holding or self.plan.mode == "required" or not self._past_lead():
            return ""
        fmt = self.plan.call_format
        if self.opened is None:
            self.opened = fmt.opens_call(self.text, self.plan.schemas)
        if self.opened is None:  # the reply may yet open with a call: hold it all
            return ""
        start = len(self.text) - len(self.text.lstrip()) if self.opened \
            else fmt.marker_at(self.text, self.sent)
        self.holding = start is not None
        hold = start if start is not None else self._may_start(fmt)
        out = self.text[self.sent:hold].rstrip()  # whitespace waits for what follows
        self.sent += len(out)
        return out

    def _past_lead(self) -> bool:
        """Drop the format's lead once complete; False while the reply may still be one."""
        lead = self.plan.call_format.lead
        if self.lead_done or not lead:
            return True
        if lead.startswith(self.text) and lead != self.text:
            return False
        self.text, self.lead_done = _after_lead(self.text, lead), True
        return True

    def _may_start(self, fmt: CallFormat) -> int:
        """Where a call may still begin: a marker's first characters at the end."""
        at = len(self.text)
        for marker in fmt.markers:
            for k in range(min(len(marker) - 1, len(self.text)), 0, -1):
                if self.text.endswith(marker[:k]):
                    at = min(at, len(self.text) - k)
                    break
        return at

    def partial_calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of each call begun in the held text, in formats whose
        arguments are JSON text: the arguments only grow, towards the canonical JSON that
        `finish` gives, by what the text written so far fixes."""
        heads = self.plan.call_format.heads
        if heads is None or not (self.holding or self.plan.mode == "required"):
            return []
        held = self.held
        found = list(heads.finditer(held))
        calls = []
        for m, after in zip(found, [*found[1:], None], strict=False):
            name = m.group(m.lastindex or 1)
            if name not in self.plan.names:
                break
            calls.append((name, json_prefix(held[m.end():after.start() if after else None])))
        return calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(text still to send, tool calls) once the reply has ended."""
        self._past_lead()
        lead = self.plan.call_format.lead if self.lead_done else ""
        content, calls = parse_reply(lead + self.text, self.plan)
        return (content or "")[self.sent:], calls


@dataclass
class CallDelta:
    """One step of a streamed call: its first (`new`: announce the call by its id and name)
    or a later fragment of its arguments."""

    index: int
    id: str
    name: str
    arguments: str  # this step's fragment of the arguments' JSON
    new: bool


@dataclass
class CallProgress:
    """What a stream has sent of each tool call: a call is announced once its name is known,
    keeping the id it was announced with, and its arguments go out in fragments whose
    concatenation is the whole reply's arguments (the canonical JSON `parse_reply` gives)."""

    plan: ToolPlan
    sent: list[CallDelta] = field(default_factory=list)  # per call: id, name, arguments sent

    def grow(self, partial: list[tuple[str, str]]) -> list[CallDelta]:
        """Steps for calls begun since the last look and for arguments that grew
        (`ToolStream.partial_calls`)."""
        return [d for i, (name, arguments) in enumerate(partial)
                if (d := self._step(i, name, arguments)) is not None]

    def finish(self, calls: list[dict[str, Any]]) -> list[CallDelta]:
        """Once the reply ends: the rest of each call's arguments, and whole calls for those
        not announced yet."""
        steps = [self._step(i, c["function"]["name"], c["function"]["arguments"], c["id"])
                 for i, c in enumerate(calls)]
        return [d for d in steps if d is not None]

    def announced(self, index: int) -> bool:
        return index < len(self.sent)

    def _step(self, index: int, name: str, arguments: str,
              given_id: str | None = None) -> CallDelta | None:
        if index == len(self.sent):
            call_id = given_id or self.plan.call_id(name, index)
            self.sent.append(CallDelta(index, call_id, name, arguments, True))
            return CallDelta(index, call_id, name, arguments, True)
        if index > len(self.sent):
            return None
        known = self.sent[index]
        grown = arguments[len(known.arguments):]
        if known.name != name or not arguments.startswith(known.arguments) or not grown:
            return None
        known.arguments = arguments
        return CallDelta(index, known.id, name, grown, False)
