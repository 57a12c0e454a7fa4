"""OpenAI's Responses API on the AsyncEngine: one `POST /v1/responses` call, body to answer,
and the stored responses it continues.

    ResponseCall.create   body -> the conversation (the stored response it continues, then its
                          input, behind `instructions`) as template messages -> one engine
                          request; tools through `tool_plan`, `text.format` and required tool
                          calls through the chat route's `chat_structure`, `reasoning.effort`
                          through the template's thinking switch
    respond / events      the Response object, or its server-sent events (`event: <type>`,
                          numbered by `sequence_number`), from one path (responses_output)
    close                 abort whatever is unfinished

Every field the body may carry either acts or is refused with a 400 naming it: built-in tools,
images and files, `include` and reasoning summaries have nothing behind them here.
`truncation: "auto"` drops the oldest items (from a user message on) until the prompt fits. Responses are kept (unless `store` is false) in the process's `ResponseStore`, so a
continuation renders the same prefix as the turn before and the engine's prefix cache serves it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastapi import FastAPI
from pydantic import Field

from kvlab.request import FinishReason, RequestOutput, SamplingParams, Structure
from kvlab.server.core.async_engine import (
    AsyncEngine,
    EngineCall,
    EngineRequest,
    EngineStepError,
    EngineUnavailable,
    Generation,
)
from kvlab.server.core.bodies import Strict, parse, parse_json_body
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.core.tools import ToolPlan, tool_plan
from kvlab.server.openai.chat import chat_structure
from kvlab.server.openai.protocol import ChatCompletionRequest
from kvlab.server.openai.responses_input import (
    items_of,
    template_messages,
    tool_choice_of,
    tool_specs,
)
from kvlab.server.openai.responses_output import Event, Reply
from kvlab.server.openai.responses_store import ResponseStore, StoredResponse, not_found

MAX_METADATA = 16  # pairs, as OpenAI bounds them


class TextConfig(Strict):
    format: dict[str, Any] | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None


@dataclass
class ResponseCall(EngineCall):
    """One Responses call: built from its body, submitted to the engine, answered."""

    engine: AsyncEngine
    serving: Serving
    store: ResponseStore
    request: EngineRequest
    reply: Reply
    settings: dict[str, Any]  # the request's settings, echoed in the Response object
    prior: list[dict[str, Any]]  # the conversation before this call's input
    input: list[dict[str, Any]]
    model: str
    stream: bool = False
    media_type: ClassVar[str] = "text/event-stream"
    id: str = ""  # set by create: serving.state_id("resp")
    created: int = field(default_factory=lambda: int(time.time()))
    gen: Generation | None = field(default=None, init=False)

    # ---- building (blocking: run it off the event loop) -------------------------------------

    @classmethod
    def create(cls, serving: Serving, body: bytes, store: ResponseStore) -> ResponseCall:
        """The call a /v1/responses body asks for."""
        req = parse(ResponsesRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        _check_settings(req)
        prior = _prior(store, req.previous_response_id)
        own = items_of(req.input)
        specs, strict = tool_specs(req.tools)
        plan = tool_plan(specs, tool_choice_of(req.tool_choice), req.parallel_tool_calls,
                         serving.tool_form, serving.marker_tokens)
        structure = serving.prepared(_structure(req, plan, serving.tool_form, strict))
        prompt = Prompt(serving, req, [*prior, *own], len(prior), plan)
        ids, start = prompt.fitted() if req.truncation == "auto" else (prompt.ids(0), 0)
        serving.check_length(ids, "input")
        if req.max_output_tokens is not None:
            serving.check_room(ids, req.max_output_tokens, "max_output_tokens")
        prior, own = prior[start:], own[max(0, start - len(prior)):]  # what was kept
        params = SamplingParams(
            max_tokens=req.max_output_tokens or serving.default_max_tokens(ids),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, structured=structure)
        request = serving.engine_requests([ids], [params], "input")[0]
        reply = Reply(plan, serving.reasoning, serving.reasoning_opens(ids))
        return cls(serving.engine, serving, store, request, reply, _settings(req), prior, own,
                   model, req.stream, id=serving.state_id("resp"))

    # ---- submitting and answering (event loop) ----------------------------------------------

    def engine_requests(self) -> list[EngineRequest]:
        return [self.request]

    async def respond(self) -> dict[str, Any]:
        """The whole Response object (the stream's events, keeping only the last)."""
        final: Event = {}
        async for event in self._run():
            final = event
        return final["response"]

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events; the call is closed however the stream ends."""
        number = 0
        try:
            async for event in self._run():
                yield _frame(event, number)
                number += 1
        except (EngineStepError, EngineUnavailable) as e:  # headers are sent: report it here
            error = {"code": "server_error", "message": str(e)}
            failed = self._response("failed", self.reply.items, error=error)
            yield _frame({"type": "response.failed", "response": failed}, number)
        finally:
            self.close()

    async def _run(self) -> AsyncIterator[Event]:
        """Every event of the response, the final Response object last."""
        gen = self.submitted()
        start = self._response("in_progress", [])
        yield {"type": "response.created", "response": start}
        yield {"type": "response.in_progress", "response": start}
        last: RequestOutput | None = None
        async for out in gen:
            last = out
            for event in self.reply.feed(out.text_delta):
                yield event
        reason = last.finish_reason if last is not None else None
        if reason == FinishReason.ABORT:
            raise EngineUnavailable("the response was ended before it finished: the server "
                                    "is shutting down")
        incomplete = reason == FinishReason.LENGTH
        for event in self.reply.finish(incomplete):
            yield event
        status = "incomplete" if incomplete else "completed"
        final = self._response(status, self.reply.items, last,
                               {"reason": "max_output_tokens"} if incomplete else None)
        self._keep(final)
        yield {"type": f"response.{status}", "response": final}

    def _response(self, status: str, output: list[dict[str, Any]],
                  last: RequestOutput | None = None, incomplete: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        completed = int(time.time()) if status == "completed" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "completed_at": completed,
                "error": error, "incomplete_details": incomplete, "model": self.model,
                "output": list(output), "usage": self._usage(last) if done else None,
                **self.settings}

    def _usage(self, last: RequestOutput | None) -> dict[str, Any]:
        prompt = len(self.request.prompt_ids)
        out = last.output_tokens if last else 0
        # the reasoning text re-tokenized: the engine counts tokens, not where they went
        thought = self.reply.reasoning
        reasoning = len(self.serving.tokenizer.encode(thought, add_special_tokens=False)) \
            if thought else 0
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": last.cached_tokens if last else 0},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": min(reasoning, out)},
                "total_tokens": prompt + out}

    def _keep(self, final: dict[str, Any]) -> None:
        if self.settings["store"]:
            self.store.put(self.id, StoredResponse(final, tuple(self.prior), tuple(self.input),
                                                   tuple(final["output"])))


def _frame(event: Event, number: int) -> str:
    data = json.dumps({**event, "sequence_number": number}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


class Prompt:
    """The prompt of a conversation's items from `start` on, behind the instructions."""

    def __init__(self, serving: Serving, req: ResponsesRequest, items: list[dict[str, Any]],
                 first_new: int, plan: ToolPlan | None) -> None:
        self.serving, self.items, self.first_new, self.plan = serving, items, first_new, plan
        self.instructions = req.instructions
        self.think = _thinking_vars(serving, req.reasoning)
        self.room = req.max_output_tokens or 1  # the reply needs this much of the context

    def ids(self, start: int) -> list[int]:
        messages = template_messages(self.items[start:], self.first_new - start)
        if self.instructions:  # one system message, as templates take it
            first = messages[0] if messages and messages[0]["role"] == "system" else None
            text = self.instructions + (f"\n\n{first['content']}" if first else "")
            messages[:1 if first else 0] = [{"role": "system", "content": text}]
        return self.serving.chat_prompt(messages, self.plan, param="input", prefill=False,
                                        **self.think)

    def fits(self, start: int) -> bool:
        try:
            ids = self.ids(start)
        except ApiError as e:
            if e.code != "context_length_exceeded":
                raise
            return False
        return len(ids) + self.room <= self.serving.engine.max_model_len

    def fitted(self) -> tuple[list[int], int]:
        """truncation "auto": (ids, start) dropping the fewest oldest items that makes the
        prompt fit; the kept part opens on a user message, as templates want. A prompt only
        gets shorter as its start moves on, so the start is found by bisection."""
        starts = [0, *(i for i, item in enumerate(self.items) if i and item["type"] ==
                       "message" and item["role"] == "user")]
        lo, hi = 0, len(starts) - 1
        if not self.fits(starts[hi]):
            return self.ids(starts[hi]), starts[hi]  # too long even so: refused by its length
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.fits(starts[mid]) else (mid + 1, hi)
        return self.ids(starts[lo]), starts[lo]


# ---- the request's settings ---------------------------------------------------------------------


def _check_settings(req: ResponsesRequest) -> None:
    """Refuse what has nothing behind it on this server."""
    if req.include:
        raise ApiError(400, f"include {req.include[0]!r} is not supported: this server has no "
                            "logprobs, encrypted reasoning or tool results to add; leave "
                            "include out", param="include")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}",
                       param="max_output_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {req.temperature}",
                       param="temperature")
    for key, value in (req.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(400, f"metadata keys hold at most 64 characters and values 512; "
                                f"{key[:64]!r} is longer", param="metadata")


def _prior(store: ResponseStore, previous: str | None) -> list[dict[str, Any]]:
    if previous is None:
        return []
    stored = store.get(previous)
    if stored is None:
        raise not_found(previous, "previous_response_id")
    return stored.conversation()


def _settings(req: ResponsesRequest) -> dict[str, Any]:
    effort = req.reasoning.effort if req.reasoning else None
    return {
        "instructions": req.instructions, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": req.store is not False,
        "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
        "truncation": req.truncation or "disabled", "user": req.user, "background": False}


def _thinking_vars(serving: Serving, reasoning: ReasoningConfig | None) -> dict[str, Any]:
    """reasoning.effort as the template's thinking switch: "none" off, any other level on
    (a template has no levels); on a model that does not think only none / minimal act."""
    if reasoning is None:
        return {}
    if reasoning.summary is not None:
        raise ApiError(400, "reasoning.summary is not supported: this server writes no "
                            "summaries; a thinking model's reasoning comes back in full as "
                            "the reasoning item's content", param="reasoning.summary")
    effort = reasoning.effort
    if effort is None:
        return {}
    if serving.reasoning is None:
        if effort in ("none", "minimal"):
            return {}
        raise ApiError(400, f"{serving.public_name} does not think (its chat template writes "
                            f"no reasoning block), so reasoning.effort {effort!r} cannot act; "
                            "send \"none\" or leave reasoning out", param="reasoning.effort")
    return serving.thinking_vars(effort != "none", "reasoning.effort")


def _structure(req: ResponsesRequest, plan: ToolPlan | None, tool_form: str,
               strict_tools: bool) -> tuple[Structure, str] | None:
    """text.format in chat's response_format shape, through the chat route's choice between
    it and the tool calls' structure."""
    chat = ChatCompletionRequest.model_construct(
        response_format=_response_format(req.text.format if req.text else None))
    found = chat_structure(chat, plan, tool_form)
    if strict_tools and plan is not None and (found is None or found[1] != "tools"):
        raise ApiError(400, "strict function tools need their calls constrained, which this "
                            "model's tool format does not allow beside text.format or in auto "
                            "mode; send tool_choice \"required\" or strict false",
                       param="tools")
    if found is not None and found[1] != "tools":
        return found[0], "text.format"
    return found


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses' flat {"type": "json_schema", "name", "schema", "strict"} in chat's shape."""
    kind = None if fmt is None else fmt.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "name", "schema", "strict", "description"}}
    if fmt is None or (kind == "text" and set(fmt) <= allowed["text"]):
        return None
    if kind == "json_object" and set(fmt) <= allowed["json_object"]:
        return {"type": "json_object"}
    if kind == "json_schema" and set(fmt) <= allowed["json_schema"] \
            and isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict) \
            and isinstance(fmt.get("strict", False), (bool, type(None))):
        return {"type": "json_schema", "json_schema": {
            "name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise ApiError(400, "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                        "or {\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}, "
                        f"\"strict\": true}}, got {fmt!r:.200}", param="text.format")


# ---- the stored responses ---------------------------------------------------------------------


def response_store(app: FastAPI) -> ResponseStore:
    """The app's store, made on first use (on the event loop, so made once) with the bounds
    of `kvlab serve --responses-max-stored / --responses-max-age`."""
    store = getattr(app.state, "responses", None)
    if store is None:
        limits = app.state.limits
        store = app.state.responses = ResponseStore(limits.responses_max_stored,
                                                    limits.responses_max_age_s)
    return store


def stored(store: ResponseStore, response_id: str) -> StoredResponse:
    found = store.get(response_id)
    if found is None:
        raise not_found(response_id)
    return found


def input_items(entry: StoredResponse, after: str | None, limit: int,
                order: str) -> dict[str, Any]:
    """A page of the response's own input items, as OpenAI lists them (newest first by
    default)."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be in [1, 100], got {limit}", param="limit")
    items = list(entry.input) if order == "asc" else list(reversed(entry.input))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"after {after!r} is not an input item of this response",
                           param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
