"""A reply's text as Anthropic content blocks: whole (one message) or streamed (events).

    text from the engine ── stop sequence cut off the end (the engine returns it, so the
       │                    answer can say which one matched)
       ├─ ReasoningStream / split_reasoning ──> a `thinking` block (where the model thinks)
       └─ ToolStream / parse_reply ──────────> a `text` block, then one `tool_use` block per
                                               call (stop_reason "tool_use"); streamed, a
                                               block starts once its call's name is written
                                               and its `input_json_delta`s follow the
                                               arguments as they grow

A stream is Anthropic's event sequence: `message_start`, `ping`, then per block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`.

kvlab's finish reasons map onto stop reasons: "stop" is "end_turn" (or "stop_sequence" where a
stop sequence matched), "length" is "max_tokens", and "abort" (the server's time limit or its
shutdown cut the reply short) is "max_tokens" too. `input_tokens` counts the prompt tokens the
prefix cache did not hold; `cache_read_input_tokens` those it did (Anthropic's split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvlab.request import FinishReason, RequestOutput
from kvlab.server.core.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from kvlab.server.core.tools import CallDelta, CallProgress, ToolPlan, ToolStream, parse_reply

STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
                FinishReason.ABORT: "max_tokens"}


@dataclass(frozen=True)
class ReplyForm:
    """What a call's reply text may hold: tool calls, reasoning, stop sequences."""

    plan: ToolPlan | None
    reasoning: ReasoningFormat | None
    inside: bool  # the prompt leaves the reply inside an open reasoning block
    stops: tuple[str, ...]

    def cut_stop(self, text: str, out: RequestOutput) -> tuple[str, str | None]:
        """(text without the stop sequence that ended it, that sequence or None).

        The engine ends a reply right after the first stop sequence it finds and returns
        it whole in the final text; where several end the text, the longest is the one it
        found (it began first)."""
        if out.finish_reason != FinishReason.STOP:
            return text, None
        ends = [s for s in self.stops if text.endswith(s)]
        if not ends:
            return text, None
        stop = max(ends, key=len)
        return text[:-len(stop)], stop


def usage(out: RequestOutput | None) -> dict[str, int]:
    prompt, cached = (out.prompt_tokens, out.cached_tokens) if out else (0, 0)
    return {"input_tokens": prompt - cached, "output_tokens": out.output_tokens if out else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(out: RequestOutput, stop: str | None, tool_use: bool) -> str:
    if tool_use:
        return "tool_use"
    if stop is not None:
        return "stop_sequence"
    return STOP_REASONS[out.finish_reason or FinishReason.STOP]


def content_blocks(text: str, form: ReplyForm) -> list[dict[str, Any]]:
    """The content blocks of a whole reply (stop sequence already cut off)."""
    reasoning, content = (None, text) if form.reasoning is None else split_reasoning(
        text, form.reasoning, form.inside)
    blocks = [] if reasoning is None else [thinking_block(reasoning)]
    uses: list[dict[str, Any]] = []
    if form.plan is not None:
        rest, calls = parse_reply(content, form.plan)
        found = tool_use_blocks(calls)
        if found:
            content, uses = rest or "", found
    if content:
        blocks.append({"type": "text", "text": content})
    return blocks + uses


def thinking_block(thinking: str) -> dict[str, Any]:
    # the signature vouches for thinking Anthropic's models wrote; kvlab checks none
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """tool_use blocks for parsed OpenAI calls; none when a call's arguments are not a JSON
    object (Anthropic's `input` is one), so the reply stays text."""
    blocks = []
    for call in calls:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            return []
        if not isinstance(arguments, dict):
            return []
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                       "name": fn["name"], "input": arguments})
    return blocks


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event, named as its `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


@dataclass
class BlockStream:
    """A reply's text deltas in, content block events out."""

    form: ReplyForm
    index: int = -1  # of the block open now, or of the last one
    open: str | None = None  # the type of the block open now
    thought: bool = False  # a thinking block came first: the text after it loses its "\n"s
    reasoning: ReasoningStream | None = field(init=False)
    tools: ToolStream | None = field(init=False)
    progress: CallProgress | None = field(init=False)
    uses: list[int] = field(default_factory=list)  # each streamed call's block index

    def __post_init__(self) -> None:
        fmt, plan = self.form.reasoning, self.form.plan
        self.reasoning = None if fmt is None else ReasoningStream(fmt, self.form.inside)
        self.tools = None if plan is None else ToolStream(plan)
        self.progress = None if plan is None else CallProgress(plan)

    def feed(self, delta: str) -> list[str]:
        reasoning, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        return self._emit(reasoning, content)

    def finish(self) -> tuple[list[str], bool]:
        """(the events that end the content, whether it ended in tool calls)."""
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        events = self._emit(reasoning, content)
        uses: list[dict[str, Any]] = []
        if self.tools is not None and self.progress is not None:
            held = self.tools.held
            rest, calls = self.tools.finish()
            uses = tool_use_blocks(calls)
            if not self.uses:  # no call announced yet: the text comes before the calls
                events, rest = events + self._text(rest if uses or not calls else held), ""
            elif not uses:  # the calls begun never completed: the reply stays text
                rest = held
            events += self._steps(self.progress.finish(calls) if uses else [])
            events += self._text(rest)
        return events + self._close(), bool(uses)

    def _emit(self, reasoning: str, content: str) -> list[str]:
        events = []
        if self.open != "thinking" and not self.thought:
            reasoning = reasoning.lstrip()
        if reasoning:
            self.thought = True
            events += self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning})
        if content and (self.tools is None or self.progress is None):
            events += self._text(content)
        elif content:
            events += self._text(self.tools.feed(content))
            events += self._steps(self.progress.grow(self.tools.partial_calls()))
        return events

    def _text(self, text: str) -> list[str]:
        if self.open != "text" and self.thought:
            text = text.lstrip("\n")
        return self._delta("text", {"type": "text_delta", "text": text}) if text else []

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        events = [] if self.open == kind else self._close() + self._start(kind)
        return events + [event("content_block_delta", {"index": self.index, "delta": delta})]

    def _start(self, kind: str) -> list[str]:
        self.index += 1
        self.open = kind
        block = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        return [event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _steps(self, steps: list[CallDelta]) -> list[str]:
        """A tool_use block for each call announced, an input_json_delta per fragment."""
        events = []
        for step in steps:
            if step.new:
                events += self._close()
                self.index += 1
                self.open = "tool_use"
                self.uses.append(self.index)
                block = {"type": "tool_use", "id": "toolu_" + step.id.removeprefix("call_"),
                         "name": step.name, "input": {}}
                events.append(event("content_block_start", {"index": self.index,
                                                            "content_block": block}))
            if step.arguments:
                events.append(event("content_block_delta", {
                    "index": self.uses[step.index],
                    "delta": {"type": "input_json_delta", "partial_json": step.arguments}}))
        return events
