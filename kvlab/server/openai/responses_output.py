"""A Responses answer's output items, built as the engine's text arrives, and the stream events
that announce them.

    Reply.feed(text delta)   -> events; Reply.finish() -> the last events
    reasoning (a thinking model's block)   a `reasoning` item, its text as `reasoning_text`
    the answer                             a `message` item with one `output_text` part
    tool calls (parsed when the reply ends) `function_call` items

One path serves both answers: a whole response is the same events with only the final items
kept, so a stream and a whole answer cannot disagree. Events are plain dicts without their
`sequence_number`, which the stream numbers as it writes them.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvlab.server.core.reasoning import ReasoningFormat, ReasoningStream
from kvlab.server.core.tools import ToolPlan, ToolStream

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """The output items of one response, in order, and the events that build them."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningFormat | None,
                 inside_reasoning: bool) -> None:
        self.tools = None if plan is None else ToolStream(plan)
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
        if self.tools is not None:
            rest, calls = self.tools.finish()
            events += self._text(rest)
        if not calls and not any(i["type"] == "message" for i in self.items):
            events += self._open_message()  # every reply without calls has its message
        events += self._close(incomplete)
        for call in calls:
            events += self._function_call(call)
        return events

    # ---- reasoning and text ---------------------------------------------------------------

    def _answer(self, content: str) -> list[Event]:
        if self.tools is not None:
            content = self.tools.feed(content)
        return self._text(content)

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

    def _function_call(self, call: dict[str, Any]) -> list[Event]:
        fn = call["function"]
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": fn["name"], "arguments": ""}
        events = self._add(item, None)
        item.update(arguments=fn["arguments"], status="completed")
        self.open = None
        index = len(self.items) - 1
        return [*events,
                {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": index, "delta": fn["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": index, "arguments": fn["arguments"]},
                {"type": "response.output_item.done", "output_index": index,
                 "item": _copy(item)}]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events must not change when the item later does)."""
    return {k: [dict(p) for p in v] if isinstance(v, list) else v for k, v in item.items()}
