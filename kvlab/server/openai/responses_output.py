"""A Responses answer's output items, built as the engine's text arrives, and the stream events
that announce them.

    Reply.feed(text delta)   -> events; Reply.finish() -> the last events
    reasoning (a thinking model's block)   a `reasoning` item, its text as `reasoning_text`
    the answer                             a `message` item with one `output_text` part
    tool calls                             `function_call` items, each added once its name
                                           is written, its arguments sent as
                                           `function_call_arguments.delta` events as they
                                           grow, done when the reply ends

One path serves both answers: a whole response is the same events with only the final items
kept, so a stream and a whole answer cannot disagree. Events are plain dicts without their
`sequence_number`, which the stream numbers as it writes them.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvlab.server.core.reasoning import ReasoningFormat, ReasoningStream
from kvlab.server.core.tools import CallDelta, CallProgress, ToolPlan, ToolStream

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """The output items of one response, in order, and the events that build them."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningFormat | None,
                 inside_reasoning: bool) -> None:
        self.tools = None if plan is None else ToolStream(plan)
        self.progress = None if plan is None else CallProgress(plan)
        self.calls: list[dict[str, Any]] = []  # the function_call items, by call index
        self.thinking = None if reasoning is None else ReasoningStream(reasoning,
                                                                       inside_reasoning)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item text is flowing into
        self.text = ""  # of the open item
        self.reasoning = ""  # all reasoning text, for the usage's reasoning tokens

    def feed(self, delta: str) -> list[Event]:
        if self.thinking is None:
            return self._answer(delta)
        reasoning, content = self.thinking.feed(delta)
        return self._reasoning(reasoning) + self._answer(content)

    def finish(self, incomplete: bool) -> list[Event]:
        """The events that end the reply; `incomplete`: it was cut at max_output_tokens."""
        events: list[Event] = []
        if self.thinking is not None:
            reasoning, content = self.thinking.finish()
            events += self._reasoning(reasoning) + self._answer(content)
        calls: list[dict[str, Any]] = []
        if self.tools is not None and self.progress is not None:
            rest, calls = self.tools.finish()
            if not self.calls:  # no call announced yet: the text ends the message before them
                events, rest = events + self._text(rest), ""
            events += self._steps(self.progress.finish(calls), incomplete)
            events += self._calls_done(len(calls))
            events += self._text(rest)
        if not calls and not any(i["type"] == "message" for i in self.items):
            events += self._open_message()  # every reply without calls has its message
        return events + self._close(incomplete)

    # ---- reasoning and text ---------------------------------------------------------------

    def _answer(self, content: str) -> list[Event]:
        if self.tools is None or self.progress is None:
            return self._text(content)
        events = self._text(self.tools.feed(content))
        return events + self._steps(self.progress.grow(self.tools.partial_calls()), False)

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "reasoning":
            text = text.lstrip()  # the newline after the opening marker
            if not text:
                return []
            events += self._close(False)
            events += self._add({"id": new_id("rs"), "type": "reasoning", "summary": [],
                                 "content": [], "status": "in_progress"},
                                {"type": "reasoning_text", "text": ""})
        if not text:
            return events
        self.text += text
        self.reasoning += text
        return [*events, self._on_open("response.reasoning_text.delta", content_index=0,
                                       delta=text)]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "message":
            if any(i["type"] == "reasoning" for i in self.items) or self.open is not None:
                text = text.lstrip("\n")  # the blank line after a reasoning block
            if not text:
                return []
            events += self._close(False) + self._open_message()
        if not text:
            return events
        self.text += text
        return [*events, self._on_open("response.output_text.delta", content_index=0,
                                       delta=text, logprobs=[])]

    def _open_message(self) -> list[Event]:
        return self._add({"id": new_id("msg"), "type": "message", "role": "assistant",
                          "status": "in_progress", "content": []},
                         {"type": "output_text", "text": "", "annotations": []})

    # ---- items opening and closing --------------------------------------------------------

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Event]:
        self.items.append(item)
        self.open, self.text = item, ""
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": _copy(item)}]
        if part is not None:
            events.append(self._on_open("response.content_part.added", content_index=0,
                                        part=part))
        return events

    def _on_open(self, kind: str, **fields: Any) -> Event:
        assert self.open is not None
        return {"type": kind, "item_id": self.open["id"],
                "output_index": len(self.items) - 1, **fields}

    def _close(self, incomplete: bool) -> list[Event]:
        """The events that end the open reasoning or message item (nothing when none is)."""
        item = self.open
        if item is None:
            return []
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        part = ({"type": kind, "text": self.text} if kind == "reasoning_text" else
                {"type": kind, "text": self.text, "annotations": []})
        item["content"] = [part]
        item["status"] = "incomplete" if incomplete else "completed"
        done = self._on_open(f"response.{kind}.done", content_index=0, text=self.text)
        if kind == "output_text":
            done["logprobs"] = []
        events = [done, self._on_open("response.content_part.done", content_index=0,
                                      part=_copy(part)),
                  {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                   "item": _copy(item)}]
        self.open, self.text = None, ""
        return events

    def _steps(self, steps: list[CallDelta], incomplete: bool) -> list[Event]:
        """A function_call item for each call announced, a delta for each fragment."""
        events: list[Event] = []
        for step in steps:
            if step.new:
                events += self._close(incomplete)
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": step.id, "name": step.name, "arguments": ""}
                events += self._add(item, None)
                self.open = None  # text after the calls opens a message of its own
                self.calls.append(item)
            item = self.calls[step.index]
            if step.arguments:
                item["arguments"] += step.arguments
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item["id"], "output_index": self._at(item),
                               "delta": step.arguments})
        return events

    def _calls_done(self, parsed: int) -> list[Event]:
        """Each call's closing events; one announced but not in the whole reply's parse (its
        arguments never completed) ends incomplete."""
        events: list[Event] = []
        for i, item in enumerate(self.calls):
            item["status"] = "completed" if i < parsed else "incomplete"
            at = self._at(item)
            events += [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": at, "arguments": item["arguments"]},
                       {"type": "response.output_item.done", "output_index": at,
                        "item": _copy(item)}]
        return events

    def _at(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events must not change when the item later does)."""
    return {k: [dict(p) for p in v] if isinstance(v, list) else v for k, v in item.items()}
