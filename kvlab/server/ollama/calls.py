"""/api/chat and /api/generate on the AsyncEngine: one API call, body to answer.

A `Call` owns one call from end to end:

    Call.chat / Call.generate   body -> one engine request (template, tools, format, options)
    submit                      the engine request -> the AsyncEngine
    events / respond            NDJSON, one object per line (the default, as Ollama streams),
                                or one object for `"stream": false`; the last one has
                                `done: true`, the done_reason, counts and durations
    close                       abort whatever is unfinished

A body with nothing to generate (/api/chat without messages, /api/generate without prompt
or system) is Ollama's "load" request: it answers at once with done_reason "load". kvlab
keeps the one served model loaded for the server's life, so `keep_alive` is accepted and
changes nothing. A mid-stream failure ends the stream with a line `{"error": "..."}`, which
Ollama's clients raise as ResponseError.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.request import RequestOutput, Structure
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
from kvlab.server.core.reasoning import ReasoningFormat
from kvlab.server.core.serving import Serving
from kvlab.server.core.tools import ToolPlan, tool_plan
from kvlab.server.ollama import replies
from kvlab.server.ollama.protocol import (
    ChatRequest,
    GenerateRequest,
    Options,
    check_model,
    check_think,
    logprobs_of,
    max_tokens_of,
    sampling_params,
    structure_of,
)
from kvlab.server.ollama.replies import Split


@dataclass
class Piece:
    """Part of a reply: what one engine output added, or (final) what the end released."""

    content: str = ""
    thinking: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    final: bool = False
    last: RequestOutput | None = None  # on the final piece


@dataclass
class Call(EngineCall):
    """One /api/chat or /api/generate call: built from its body, submitted, answered."""

    serving: Serving
    kind: str  # "chat" | "generate"
    model: str
    stream: bool
    request: EngineRequest | None  # None: a load request, answered at once
    started: float
    plan: ToolPlan | None = None
    reasoning: ReasoningFormat | None = None
    inside_reasoning: bool = False  # the prompt leaves the reply inside a reasoning block
    context: list[int] | None = None  # /api/generate: prompt ids, the reply's `context`
    media_type: ClassVar[str] = "application/x-ndjson"
    gen: Generation | None = field(default=None, init=False)
    reply_ids: list[int] = field(default_factory=list, init=False)

    # ---- building (blocking: run it off the event loop) -------------------------------------

    @classmethod
    def chat(cls, serving: Serving, body: bytes) -> Call:
        """The call an /api/chat body asks for."""
        started = time.perf_counter()
        req = parse(ChatRequest, parse_json_body(body))
        model = check_model(serving, req.model)
        think = check_think(req.think)
        if not req.messages:
            return cls(serving, "chat", model, req.stream, None, started)
        plan = tool_plan(req.tools, None, None, serving.tool_form,
                         serving.marker_tokens) if req.tools else None
        structure = _structure(req.format, plan, serving.tool_form)
        messages = [m.as_template_dict(i) for i, m in enumerate(req.messages)]
        ids = serving.chat_prompt(messages, plan, **serving.thinking_vars(think, "think"))
        request = _engine_request(serving, req.options, ids, serving.prepared(structure),
                                  logprobs_of(req), "messages")
        return cls(serving, "chat", model, req.stream, request, started, plan,
                   serving.reasoning, serving.reasoning_opens(ids))

    @classmethod
    def generate(cls, serving: Serving, body: bytes) -> Call:
        """The call an /api/generate body asks for."""
        started = time.perf_counter()
        req = parse(GenerateRequest, parse_json_body(body))
        model = check_model(serving, req.model)
        _refuse_unsupported(req)
        think = check_think(req.think)
        if not req.prompt and not req.system:
            return cls(serving, "generate", model, req.stream, None, started)
        ids = _generate_prompt(serving, req, think)
        structure = serving.prepared(structure_of(req.format))
        request = _engine_request(serving, req.options, ids, structure, logprobs_of(req),
                                  "prompt", chat=not req.raw)
        if req.raw:  # no template around the prompt: no reasoning to split, no context
            return cls(serving, "generate", model, req.stream, request, started)
        return cls(serving, "generate", model, req.stream, request, started, None,
                   serving.reasoning, serving.reasoning_opens(ids), context=ids)

    # ---- submitting and answering (event loop) ----------------------------------------------

    @property
    def engine(self) -> AsyncEngine:  # type: ignore[override]
        return self.serving.engine

    def engine_requests(self) -> list[EngineRequest]:
        return [] if self.request is None else [self.request]

    async def respond(self) -> dict[str, Any]:
        """The whole answer as one object."""
        if self.request is None:
            return self._loaded()
        whole = Piece()
        async for piece in self._pieces():
            whole.content += piece.content
            whole.thinking += piece.thinking
            whole.logprobs += piece.logprobs
            whole.calls += piece.calls
            whole.last = piece.last or whole.last
        whole.final = True
        return self._body(whole)

    async def events(self) -> AsyncIterator[str]:
        """NDJSON lines; the call is closed however the stream ends."""
        try:
            if self.request is None:
                yield _line(self._loaded())
                return
            async for piece in self._pieces():
                yield _line(self._body(piece))
        except (EngineStepError, EngineUnavailable) as e:  # headers are sent: say it in a line
            yield _line({"error": str(e)})
        finally:
            self.close()

    async def _pieces(self) -> AsyncIterator[Piece]:
        gen = self.submitted()
        split = Split(self.reasoning, self.inside_reasoning, self.plan)
        tokenizer = self.serving.tokenizer
        last = None
        async for out in gen:
            last = out
            self.reply_ids += out.new_token_ids
            thinking, content = split.feed(out.text_delta)
            if thinking or content or out.logprobs:
                yield Piece(content, thinking, replies.logprobs(tokenizer, out.logprobs))
        thinking, content, calls = split.finish()
        yield Piece(content, thinking, [], calls, final=True, last=last)

    def _body(self, piece: Piece) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": replies.created_at()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.thinking:
                message["thinking"] = piece.thinking
            if piece.calls:
                message["tool_calls"] = piece.calls
            body["message"] = message
        else:
            body["response"] = piece.content
            if piece.thinking:
                body["thinking"] = piece.thinking
        if piece.logprobs:
            body["logprobs"] = piece.logprobs
        body["done"] = piece.final
        if piece.final:
            body["done_reason"] = replies.done_reason(piece.last)
            body.update(replies.stats(self.started, piece.last))
            if self.context is not None:
                body["context"] = self.context + self.reply_ids
        return body

    def _loaded(self) -> dict[str, Any]:
        """Ollama's answer to a load request (the model is already loaded)."""
        reply = ({"message": {"role": "assistant", "content": ""}} if self.kind == "chat"
                 else {"response": ""})
        return {"model": self.model, "created_at": replies.created_at(), **reply,
                "done": True, "done_reason": "load"}


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _structure(fmt: Any, plan: ToolPlan | None,
               tool_form: str) -> tuple[Structure, str] | None:
    """The request's own format, or else the form its tool calls must follow."""
    structure = structure_of(fmt)
    if structure is None and plan is not None:
        calls = plan.structure(tool_form)
        return None if calls is None else (calls, "tools")
    return structure


def _engine_request(serving: Serving, options: Options | None, ids: list[int],
                    structure: Structure | None, logprobs: int | None,
                    param: str, chat: bool = True) -> EngineRequest:
    options = options or Options()
    params = sampling_params(options, max_tokens_of(serving, options, ids), structure,
                             logprobs)
    return serving.engine_requests([ids], [params], param, chat=chat)[0]


def _refuse_unsupported(req: GenerateRequest) -> None:
    """Fields Ollama accepts that kvlab cannot act on: a 400 each, never ignored."""
    if req.template:
        raise ApiError(400, "template is not supported: kvlab renders the model's own chat "
                            "template; send raw: true with a prompt you templated yourself",
                       param="template")
    if req.suffix:
        raise ApiError(400, "suffix (fill in the middle) is not supported: the served model "
                            "has no fill-in-the-middle tokens", param="suffix")
    if req.images:
        raise ApiError(400, "images are not supported: the served model reads text only",
                       param="images")
    if req.raw and (req.system or req.think is not None):
        raise ApiError(400, "a raw prompt is sent as is, without the template that would "
                            "place system or think; drop them or raw", param="raw")


def _generate_prompt(serving: Serving, req: GenerateRequest, think: bool | None) -> list[int]:
    """The prompt ids: the prompt as is (raw) or in the chat template as one user turn
    after the system message, continuing `context` (an earlier reply's ids) when given."""
    prompt = req.prompt or ""
    if req.raw:
        ids = serving.encode(prompt)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
            [{"role": "user", "content": prompt}]
        ids = serving.chat_prompt(messages, None, param="prompt",
                                  **serving.thinking_vars(think, "think"))
    if not req.context:
        return ids
    vocab = serving.tokenizer.vocab_size
    bad = [i for i in req.context if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"context holds {bad[0]}, which is no token id (the vocabulary "
                            f"has {vocab}); send the context an earlier reply returned",
                       param="context")
    bos = serving.tokenizer.bos_id
    if bos is not None and ids[:1] == [bos]:  # the turn continues a sequence that has it
        ids = ids[1:]
    return list(req.context) + ids
