"""How completions and chat completions spell choices, deltas, logprobs and usage.

The two endpoints differ only in these shapes (`text` vs `message` / `delta`, legacy vs chat
logprobs), so each is a small Format class and the serving code is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.logprobs import clamped, completion_logprobs, token_text
from kvlab.request import RequestOutput, TokenLogprob
from kvlab.server.core.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from kvlab.server.core.tools import ToolPlan, ToolStream, parse_reply
from kvlab.tokenizer import Tokenizer


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    prompt_tokens: int
    echo: str = ""  # the prompt text, for completions with echo
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    last: RequestOutput | None = None
    offset: int = 0  # characters streamed so far (legacy logprobs' text_offset)

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text_delta)
        self.logprobs.extend(out.logprobs)
        self.last = out
        if out.finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Each prompt counts once however many choices it has (as OpenAI counts with n > 1)."""
    firsts = [c for c in choices if c.index % n == 0]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.last.output_tokens for c in choices if c.last)
    cached = sum(c.last.cached_tokens for c in firsts if c.last)
    forced = sum(c.last.forced_tokens for c in choices if c.last)
    drafted = sum(c.last.draft_tokens for c in choices if c.last)
    accepted = sum(c.last.accepted_tokens for c in choices if c.last)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            # kvlab's own: output tokens a structure fixed, appended without sampling; and
            # speculative decoding's proposals, in OpenAI's predicted-output fields
            "completion_tokens_details": {"forced_tokens": forced,
                                          "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


class Format:
    object = ""
    chunk_object = ""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return token_text(self.tokenizer, token_id)

    def choice(self, c: Choice, num_logprobs: int | None) -> dict[str, Any]:
        raise NotImplementedError

    def first_delta(self, c: Choice) -> dict[str, Any] | None:
        raise NotImplementedError

    def delta(self, c: Choice, out: RequestOutput,
              num_logprobs: int | None) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"

    def choice(self, c: Choice, num_logprobs: int | None) -> dict[str, Any]:
        text = c.echo + "".join(c.text)
        logprobs = (None if num_logprobs is None
                    else self.logprobs(c.logprobs, num_logprobs, len(c.echo)))
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}

    def first_delta(self, c: Choice) -> dict[str, Any] | None:
        if not c.echo:
            return None
        c.offset = len(c.echo)
        return {"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}

    def delta(self, c: Choice, out: RequestOutput,
              num_logprobs: int | None) -> dict[str, Any] | None:
        if not (out.text_delta or out.finished or out.logprobs):
            return None
        logprobs = (None if num_logprobs is None
                    else self.logprobs(out.logprobs, num_logprobs, c.offset))
        c.offset += len(out.text_delta)
        return {"index": c.index, "text": out.text_delta, "logprobs": logprobs,
                "finish_reason": out.finish_reason.value if out.finish_reason else None}

    def logprobs(self, items: list[TokenLogprob], k: int, offset: int) -> dict[str, Any]:
        """Legacy shape: parallel lists; top_logprobs maps token text -> logprob."""
        return completion_logprobs(self.tokenizer, items, k, offset)


class ChatFormat(Format):
    """Chat replies; where the model thinks (`reasoning`), what it writes between its think
    markers is `reasoning_content` (as vLLM and llama-server name it), not content."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, reasoning: ReasoningFormat | None = None,
                 thinking: bool = False) -> None:
        super().__init__(tokenizer)
        self.reasoning = reasoning
        self.thinking = thinking  # the prompt leaves the reply inside a think block
        self._reasoning: dict[int, ReasoningStream] = {}

    def choice(self, c: Choice, num_logprobs: int | None) -> dict[str, Any]:
        logprobs = (None if num_logprobs is None
                    else {"content": self.logprobs(c.logprobs, num_logprobs), "refusal": None})
        text = "".join(c.text)
        reasoning, content = (split_reasoning(text, self.reasoning, self.thinking)
                              if self.reasoning else (None, text))
        message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": []}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"index": c.index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "message": message}

    def first_delta(self, c: Choice) -> dict[str, Any] | None:
        return {"index": c.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, c: Choice, out: RequestOutput,
              num_logprobs: int | None) -> dict[str, Any] | None:
        reasoning, text = "", out.text_delta
        if self.reasoning is not None:
            stream = self._reasoning.setdefault(
                c.index, ReasoningStream(self.reasoning, self.thinking))
            reasoning, text = stream.feed(text)
            if out.finished:
                more_r, more_c = stream.finish()
                reasoning, text = reasoning + more_r, text + more_c
        body = self.content_delta(c, out, text, num_logprobs)
        if reasoning:
            body = body or self._delta_body(c, out, "", num_logprobs)
            body["delta"]["reasoning_content"] = reasoning
        return body

    def content_delta(self, c: Choice, out: RequestOutput, text: str,
                      num_logprobs: int | None) -> dict[str, Any] | None:
        """The chunk for `text`, the content part of this output (None: nothing to send)."""
        if not (text or out.finished or out.logprobs):
            return None
        return self._delta_body(c, out, text, num_logprobs)

    def _delta_body(self, c: Choice, out: RequestOutput, text: str,
                    num_logprobs: int | None) -> dict[str, Any]:
        logprobs = (None if num_logprobs is None
                    else {"content": self.logprobs(out.logprobs, num_logprobs),
                          "refusal": None})
        delta = {"content": text} if text or not out.finished else {}
        return {"index": c.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": out.finish_reason.value if out.finish_reason else None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_text(token_id), "logprob": clamped(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def logprobs(self, items: list[TokenLogprob], k: int) -> list[dict[str, Any]]:
        return [{**self._entry(i.token_id, i.logprob),
                 "top_logprobs": [self._entry(t, lp) for t, lp in i.top[:k]]} for i in items]


class ToolFormat(ChatFormat):
    """Chat replies that may carry tool calls: parsed out of the content; streamed as
    `tool_calls` deltas as they are written (a call's index, id and name once its name is
    known, then fragments of its arguments whose concatenation is the whole reply's
    arguments), the rest when the reply ends. Text that cannot be a call streams as usual."""

    def __init__(self, tokenizer: Tokenizer, plan: ToolPlan,
                 reasoning: ReasoningFormat | None = None, thinking: bool = False) -> None:
        super().__init__(tokenizer, reasoning, thinking)
        self.plan = plan
        self._streams: dict[int, ToolStream] = {}
        self._sent: dict[int, list[_SentCall]] = {}  # per choice: the calls streamed so far

    def choice(self, c: Choice, num_logprobs: int | None) -> dict[str, Any]:
        body = super().choice(c, num_logprobs)
        content, calls = parse_reply(body["message"]["content"], self.plan)
        if calls:
            body["message"].update(content=content, tool_calls=calls)
            body["finish_reason"] = "tool_calls"
        return body

    def content_delta(self, c: Choice, out: RequestOutput, text: str,
                      num_logprobs: int | None) -> dict[str, Any] | None:
        stream = self._streams.setdefault(c.index, ToolStream(self.plan))
        sent = self._sent.setdefault(c.index, [])
        text = stream.feed(text)
        calls: list[dict[str, Any]] = []
        if out.finished:
            rest, calls = stream.finish()
            text += rest
            deltas = _final_deltas(sent, calls)
        else:
            deltas = _growing_deltas(sent, stream.partial_calls(), self.plan)
        body = super().content_delta(c, out, text, num_logprobs)
        if deltas:
            body = body or self._delta_body(c, out, text, num_logprobs)
            if not text:
                body["delta"].pop("content", None)
            body["delta"]["tool_calls"] = deltas
        if body is not None and calls:
            body["finish_reason"] = "tool_calls"
        return body


@dataclass
class _SentCall:
    name: str
    arguments: str  # the arguments' JSON streamed so far


def _growing_deltas(sent: list[_SentCall], partial: list[tuple[str, str]],
                    plan: ToolPlan) -> list[dict[str, Any]]:
    """Deltas for calls begun since the last chunk (index, id, name) and for arguments that
    grew (the new fragment)."""
    deltas = []
    for i, (name, arguments) in enumerate(partial):
        if i == len(sent):
            sent.append(_SentCall(name, arguments))
            deltas.append({"index": i, "id": plan.call_id(name, i), "type": "function",
                           "function": {"name": name, "arguments": arguments}})
        elif i < len(sent) and sent[i].name == name and len(arguments) > len(
                sent[i].arguments) and arguments.startswith(sent[i].arguments):
            deltas.append({"index": i, "function": {
                "arguments": arguments[len(sent[i].arguments):]}})
            sent[i].arguments = arguments
    return deltas


def _final_deltas(sent: list[_SentCall], calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Once the reply ends: the rest of each streamed call's arguments, and whole calls for
    those not streamed yet."""
    deltas = []
    for i, call in enumerate(calls):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if i >= len(sent) or sent[i].name != name:
            deltas.append({"index": i, **call})
        elif len(arguments) > len(sent[i].arguments) and arguments.startswith(
                sent[i].arguments):
            deltas.append({"index": i, "function": {
                "arguments": arguments[len(sent[i].arguments):]}})
    return deltas
