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
loop. `Serving` holds what every call shares: the model's names, its tokenizer, its tool-call
form and the limits its context sets. A prompt whose UTF-8 length alone proves it cannot fit
the context (more bytes than the context holds tokens times the longest token) is refused
before it is tokenized.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvlab.errors import RequestError
from kvlab.request import Structure
from kvlab.server.openai.async_engine import (
    AsyncEngine,
    EngineRequest,
    EngineStepError,
    EngineUnavailable,
    Generation,
)
from kvlab.server.openai.formats import (
    ChatFormat,
    Choice,
    CompletionFormat,
    Format,
    ToolFormat,
    usage,
)
from kvlab.server.openai.guard import parse_json_body
from kvlab.server.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    max_tokens_of,
    parse,
    sampling_params,
    structure_of,
)
from kvlab.server.openai.tools import ToolPlan, template_messages, tool_plan
from kvlab.tokenizer.chat import template_variables

# A normalizer (NFC, ...) may shorten text before tokenizing; bytes / token is bounded by this
# times the longest token's bytes.
_NORMALIZER_SLACK = 4


class Serving:
    """What every call on this server is built against (read-only once made)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        name = engine.model_name
        self.model_names = {name, name.removesuffix(".gguf")}
        longest = max((len(self.tokenizer.token_bytes(i))
                       for i in range(self.tokenizer.vocab_size)), default=16)
        self.max_prompt_bytes = engine.max_model_len * max(longest, 1) * _NORMALIZER_SLACK
        template = self.tokenizer.chat_template
        self.native_tools = template is not None and "tools" in template_variables(template)
        # which tool-call format decoding can enforce in auto mode (ToolPlan.structure)
        self.tool_form = ("generic" if not self.native_tools else
                          "qwen" if "<tool_call>" in (template or "") else
                          "llama" if "<|python_tag|>" in (template or "") else "other")

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return self.engine.model_name

    def check_fits(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, text too long in bytes for any tokenization to fit."""
        if len(text) * 4 <= self.max_prompt_bytes:  # UTF-8 is at most 4 bytes a character
            return
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"the prompt is {size} bytes; no tokenization of that fits the "
                                f"context of {self.engine.max_model_len} tokens (at most "
                                f"{self.max_prompt_bytes} bytes could)", param=param,
                           code="context_length_exceeded")

    def prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_fits(prompt, "prompt")
        return self.tokenizer.encode(prompt)

    def chat_structure(self, req: ChatCompletionRequest,
                       plan: ToolPlan | None) -> tuple[Structure, str] | None:
        """The request's own structure, or the one its tool calls must follow."""
        structure = structure_of(req)
        if plan is not None and plan.mode == "required" and structure is not None:
            raise ApiError(400, "a required tool call already fixes the reply's form; drop "
                                "the structure or use tool_choice \"auto\"",
                           param="tool_choice")
        calls = None if plan is None else plan.structure(self.tool_form)
        if structure is None and calls is not None:  # in auto mode the user's structure wins
            return calls, "tools"
        return structure

    def prepared(self, found: tuple[Structure, str] | None) -> Structure | None:
        """Compile the structure here (worker thread), so the engine finds it ready."""
        if found is None:
            return None
        structure, param = found
        try:
            self.engine.prepare_structure(structure)
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None
        return structure


@dataclass
class Call:
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
    created: int = field(default_factory=lambda: int(time.time()))
    gen: Generation | None = field(default=None, init=False)  # once submitted

    # ---- building (blocking: run it off the event loop) -------------------------------------

    @classmethod
    def completion(cls, serving: Serving, body: bytes) -> Call:
        """The call a /v1/completions body asks for."""
        req = parse(CompletionRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        check_common(req)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           param="echo")
        prompts = _completion_prompts(req.prompt)
        echo = [serving.prompt_text(p) if req.echo else "" for p in prompts]
        ids = [serving.encode(p) for p in prompts]
        structure = serving.prepared(structure_of(req))
        return cls(serving.engine, f"cmpl-{uuid.uuid4().hex}", model,
                   CompletionFormat(serving.tokenizer),
                   _engine_requests(serving.engine, req, ids, structure), req.n,
                   req.include_usage, echo, req.stream)

    @classmethod
    def chat(cls, serving: Serving, body: bytes) -> Call:
        """The call a /v1/chat/completions body asks for."""
        req = parse(ChatCompletionRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        check_common(req)
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        structure = serving.chat_structure(req, plan)
        messages, extra = template_messages([m.as_template_dict() for m in req.messages],
                                            plan, serving.native_tools)
        tokenizer = serving.tokenizer
        serving.check_fits(tokenizer.apply_chat_template(messages, **extra), "messages")
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True, **extra)
        chat = ChatFormat(tokenizer) if plan is None else ToolFormat(tokenizer, plan)
        return cls(serving.engine, f"chatcmpl-{uuid.uuid4().hex}", model, chat,
                   _engine_requests(serving.engine, req, [ids], serving.prepared(structure)),
                   req.n, req.include_usage, [""], req.stream)

    # ---- submitting and answering (event loop) ----------------------------------------------

    async def submit(self, deadline: float | None = None) -> None:
        """Queue the engine requests; raises RequestError, EngineOverloaded, ...

        `deadline` is on the event loop's clock: the call's choices end there."""
        self.gen = await self.engine.add(self.requests, deadline)

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        if self.gen is not None:
            self.gen.close()

    def choices(self) -> dict[str, Choice]:
        return {r.request_id: Choice(i, len(r.prompt_ids), self.echo_texts[i // self.n])
                for i, r in enumerate(self.requests)}

    async def respond(self) -> dict[str, Any]:
        """The whole answer as one JSON object."""
        gen = self._submitted()
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
        gen = self._submitted()
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

    def _submitted(self) -> Generation:
        if self.gen is None:
            raise RuntimeError(f"call {self.id} was not submitted")
        return self.gen

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


def _engine_requests(engine: AsyncEngine, req: CompletionRequest | ChatCompletionRequest,
                     prompts: list[list[int]],
                     structure: Structure | None) -> list[EngineRequest]:
    """prompts x n engine requests; a prompt the context cannot hold is refused here, not on
    the engine thread."""
    call_id = uuid.uuid4().hex
    out = []
    for p, ids in enumerate(prompts):
        if len(ids) >= engine.max_model_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds "
                                f"{engine.max_model_len} (prompt + max_tokens)",
                           param="messages" if isinstance(req, ChatCompletionRequest)
                           else "prompt", code="context_length_exceeded")
        max_tokens = max_tokens_of(req)
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, engine.max_model_len - len(ids))
        for i in range(req.n):
            out.append(EngineRequest(f"{call_id}-{p}-{i}", ids,
                                     sampling_params(req, max_tokens, i, structure)))
    return out
