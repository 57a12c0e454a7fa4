"""OpenAI completions and chat completions on the AsyncEngine: one API call, body to answer.

A `Call` owns one API call from end to end:

    Call.completion / Call.chat   body -> engine requests (prompts x n choices, choice index =
                                  prompt index * n + i) and the wire format to answer in
    submit                        the engine requests -> the AsyncEngine (one Generation)
    respond / events              the whole answer as JSON, or server-sent events: one chunk
                                  per engine output, then usage and `[DONE]`
    close                         abort whatever is unfinished (the client left, or it ended)

Building a call (JSON decoding, validation, chat template, tokenization) is plain blocking
work: the app runs `Call.completion` / `Call.chat` in a worker thread, never on the event
loop. `Serving` (kvlab.server.core) holds what every call shares: the model's names, its
tokenizer, its tool-call form and the limits its context sets.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.request import Structure
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
from kvlab.server.openai.formats import (
    ChatFormat,
    Choice,
    CompletionFormat,
    Format,
    ToolFormat,
    usage,
)
from kvlab.server.openai.infill import completion_ids
from kvlab.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    max_tokens_of,
    sampling_params,
    structure_of,
)


@dataclass
class Call(EngineCall):
    """One API call: built from its body, submitted to the engine, answered."""

    engine: AsyncEngine
    id: str
    model: str
    format: Format
    requests: list[EngineRequest]
    n: int
    include_usage: bool
    echo_texts: list[str]  # per prompt; empty strings without echo
    stream: bool = False
    media_type: ClassVar[str] = "text/event-stream"
    created: int = field(default_factory=lambda: int(time.time()))
    gen: Generation | None = field(default=None, init=False)  # once submitted

    # ---- building (blocking: run it off the event loop) -------------------------------------

    @classmethod
    def completion(cls, serving: Serving, body: bytes) -> Call:
        """The call a /v1/completions body asks for."""
        req = parse(CompletionRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        check_common(req)
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           param="echo")
        prompts = _completion_prompts(req.prompt)
        echo = [serving.prompt_text(p) if req.echo else "" for p in prompts]
        ids = [completion_ids(serving, req, p) for p in prompts]  # with suffix: FIM
        structure = serving.prepared(structure_of(req))
        return cls(serving.engine, f"cmpl-{uuid.uuid4().hex}", model,
                   CompletionFormat(serving.tokenizer),
                   _engine_requests(serving, req, ids, structure), req.n,
                   req.include_usage, echo, req.stream)

    @classmethod
    def chat(cls, serving: Serving, body: bytes) -> Call:
        """The call a /v1/chat/completions body asks for."""
        req = parse(ChatCompletionRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        check_common(req)
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                         serving.tool_form, serving.marker_tokens)
        structure = chat_structure(req, plan, serving.tool_form)
        ids = serving.chat_prompt([m.as_template_dict() for m in req.messages], plan,
                                  prefill=_prefill(req), **_template_vars(serving, req))
        tokenizer, thinking = serving.tokenizer, serving.reasoning_opens(ids)
        chat = (ChatFormat(tokenizer, serving.reasoning, thinking) if plan is None else
                ToolFormat(tokenizer, plan, serving.reasoning, thinking))
        return cls(serving.engine, f"chatcmpl-{uuid.uuid4().hex}", model, chat,
                   _engine_requests(serving, req, [ids], serving.prepared(structure)),
                   req.n, req.include_usage, [""], req.stream)

    # ---- submitting and answering (event loop) ----------------------------------------------

    def engine_requests(self) -> list[EngineRequest]:
        return self.requests

    def choices(self) -> dict[str, Choice]:
        return {r.request_id: Choice(i, len(r.prompt_ids), self.echo_texts[i // self.n])
                for i, r in enumerate(self.requests)}

    async def respond(self) -> dict[str, Any]:
        """The whole answer as one JSON object."""
        gen = self.submitted()
        choices = self.choices()
        async for out in gen:
            choices[out.request_id].add(out)
        params = {r.request_id: r.params for r in self.requests}
        body = [self.format.choice(c, params[rid].logprobs) for rid, c in choices.items()]
        return {"id": self.id, "object": self.format.object, "created": self.created,
                "model": self.model, "choices": body,
                "usage": usage(list(choices.values()), self.n), "system_fingerprint": None}

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events; the call is closed however the stream ends."""
        gen = self.submitted()
        choices = self.choices()
        params = {r.request_id: r.params for r in self.requests}
        try:
            for c in choices.values():
                first = self.format.first_delta(c)
                if first is not None:
                    yield self._event([first])
            async for out in gen:
                c = choices[out.request_id]
                c.last = out
                delta = self.format.delta(c, out, params[out.request_id].logprobs)
                if delta is not None:
                    yield self._event([delta])
            if self.include_usage:
                yield self._event([], usage(list(choices.values()), self.n))
        except EngineStepError as e:  # headers are already sent: report it as an event
            err = ApiError(500, str(e), type_="internal_server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        except EngineUnavailable as e:
            err = ApiError(503, str(e), type_="service_unavailable_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            self.close()
        yield "data: [DONE]\n\n"

    def _event(self, choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> str:
        chunk: dict[str, Any] = {"id": self.id, "object": self.format.chunk_object,
                                 "created": self.created, "model": self.model,
                                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = use
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise ApiError(400, "the prompt is empty; send at least one token", param="prompt")
    return list(prompt)


def _engine_requests(serving: Serving, req: CompletionRequest | ChatCompletionRequest,
                     prompts: list[list[int]],
                     structure: Structure | None) -> list[EngineRequest]:
    """prompts x n engine requests (choice index = prompt index * n + i)."""
    param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    ids, params = [], []
    for p in prompts:
        serving.check_length(p, param)
        max_tokens = max_tokens_of(req)
        if max_tokens is None:
            max_tokens = serving.default_max_tokens(p)
        for i in range(req.n):
            ids.append(p)
            params.append(sampling_params(req, max_tokens, i, structure))
    return serving.engine_requests(ids, params, param,
                                   chat=isinstance(req, ChatCompletionRequest))


def chat_structure(req: ChatCompletionRequest, plan: ToolPlan | None,
                   tool_form: str) -> tuple[Structure, str] | None:
    """The request's own structure, or the one its tool calls must follow."""
    structure = structure_of(req)
    if plan is not None and plan.mode == "required" and structure is not None:
        raise ApiError(400, "a required tool call already fixes the reply's form; drop "
                            "the structure or use tool_choice \"auto\"",
                       param="tool_choice")
    # in auto mode the user's structure wins
    return structure if structure is not None else tool_structure(plan, tool_form)


def _template_vars(serving: Serving, req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs and what reasoning_effort sets; one variable set twice is a 400."""
    effort = serving.effort_vars(req.reasoning_effort, "reasoning_effort")
    both = sorted(set(effort) & set(req.chat_template_kwargs))
    if both:
        raise ApiError(400, f"reasoning_effort sets the template's {both[0]!r}; give it there "
                            "or in chat_template_kwargs, not both", param="reasoning_effort")
    return {**req.chat_template_kwargs, **effort}


def _prefill(req: ChatCompletionRequest) -> bool | None:
    """vLLM's two flags; unset, a trailing assistant message is continued (llama-server)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message needs add_generation_prompt false: the "
                            "reply cannot both continue the last message and open a new one",
                       param="continue_final_message")
    if req.continue_final_message:
        return True
    return False if req.add_generation_prompt else None
