"""One Anthropic Messages call on the AsyncEngine, body to answer, and the token count.

    MessagesCall.build   body -> template messages, tool plan, thinking switch -> one engine
                         request (blocking: the app runs it in a worker thread)
    submit               the engine request -> the AsyncEngine
    respond / events     the whole message as JSON, or Anthropic's server-sent events
                         (`message_start` waits for the engine's first output, which says how
                         much of the prompt the prefix cache held)
    close                abort whatever is unfinished
    count_tokens         /v1/messages/count_tokens: the prompt `build` would make, counted
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.request import RequestOutput
from kvlab.server.anthropic.protocol import (
    Conversation,
    MessagesRequest,
    error_body,
    openai_tool_choice,
    openai_tools,
    sampling_params,
    template_messages,
    thinking_switch,
)
from kvlab.server.anthropic.reply import (
    BlockStream,
    ReplyForm,
    content_blocks,
    event,
    stop_reason,
    usage,
)
from kvlab.server.core.async_engine import (
    AsyncEngine,
    EngineCall,
    EngineRequest,
    EngineStepError,
    EngineUnavailable,
    Generation,
)
from kvlab.server.core.bodies import parse, parse_json_body
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.core.tools import ToolPlan, tool_plan, tool_structure


def prompt_of(serving: Serving, conv: Conversation,
              max_tokens: int | None) -> tuple[list[int], ToolPlan | None]:
    """(prompt ids, tool plan) of a conversation."""
    choice, parallel = openai_tool_choice(conv)
    plan = tool_plan(openai_tools(conv), choice, parallel, serving.tool_form,
                     serving.marker_tokens)
    think = serving.thinking_vars(thinking_switch(conv, max_tokens), "thinking")
    return serving.chat_prompt(template_messages(conv), plan, **think), plan


def count_tokens(serving: Serving, body: bytes) -> dict[str, Any]:
    """The /v1/messages/count_tokens answer."""
    conv = parse(Conversation, parse_json_body(body))
    serving.check_model(conv.model)
    ids, _ = prompt_of(serving, conv, None)
    return {"input_tokens": len(ids)}


@dataclass
class MessagesCall(EngineCall):
    """One /v1/messages call: built from its body, submitted to the engine, answered."""

    engine: AsyncEngine
    id: str
    model: str
    request: EngineRequest
    form: ReplyForm
    stream: bool = False
    media_type: ClassVar[str] = "text/event-stream"
    gen: Generation | None = field(default=None, init=False)  # once submitted
    started: bool = field(default=False, init=False)  # message_start is out

    @classmethod
    def build(cls, serving: Serving, body: bytes) -> MessagesCall:
        req = parse(MessagesRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        ids, plan = prompt_of(serving, req, req.max_tokens)
        params = sampling_params(req, serving.prepared(tool_structure(plan, serving.tool_form)))
        budget = req.thinking.budget_tokens if req.thinking is not None else None
        [request] = serving.engine_requests([ids], [params], reasoning_budget=budget)
        form = ReplyForm(plan, serving.reasoning, serving.reasoning_opens(ids), params.stop)
        return cls(serving.engine, f"msg_{uuid.uuid4().hex[:24]}", model, request, form,
                   req.stream)

    def engine_requests(self) -> list[EngineRequest]:
        return [self.request]

    async def respond(self) -> dict[str, Any]:
        """The whole message."""
        texts, last = [], None
        try:
            async for out in self.submitted():
                texts.append(out.text_delta)
                last = out
        except EngineStepError as e:  # an error the server reports, not a bug of the call
            raise ApiError(500, str(e)) from None
        assert last is not None  # a generation ends with a finished output
        text, stop = self.form.cut_stop("".join(texts), last)
        blocks = content_blocks(text, self.form)
        tool_use = any(b["type"] == "tool_use" for b in blocks)
        return self._message(blocks, usage(last), stop_reason(last, stop, tool_use), stop)

    async def events(self) -> AsyncIterator[str]:
        """Anthropic's event stream; the call is closed however the stream ends."""
        blocks = BlockStream(self.form)
        try:
            async for out in self.submitted():
                for chunk in self._on_output(out, blocks):
                    yield chunk
        except EngineStepError as e:  # headers are already sent: report it as an event
            yield event("error", error_body(ApiError(500, str(e))))
        except EngineUnavailable as e:
            yield event("error", error_body(ApiError(503, str(e))))
        finally:
            self.close()

    def _on_output(self, out: RequestOutput, blocks: BlockStream) -> list[str]:
        events = []
        if not self.started:
            self.started = True
            start = self._message([], {**usage(out), "output_tokens": 0})
            events += [event("message_start", {"message": start}), event("ping", {})]
        delta, stop = out.text_delta, None
        if out.finished:
            delta, stop = self.form.cut_stop(delta, out)
        events += blocks.feed(delta)
        if out.finished:
            ending, tool_use = blocks.finish()
            events += ending
            events.append(event("message_delta", {
                "delta": {"stop_reason": stop_reason(out, stop, tool_use),
                          "stop_sequence": stop},
                "usage": usage(out)}))
            events.append(event("message_stop", {}))
        return events

    def _message(self, content: list[dict[str, Any]], use: dict[str, int],
                 reason: str | None = None, stop: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop,
                "usage": {**use, "service_tier": "standard"}}

    def _submitted(self) -> Generation:
        if self.gen is None:
            raise RuntimeError(f"call {self.id} was not submitted")
        return self.gen
