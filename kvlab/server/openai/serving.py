"""OpenAI completions and chat completions on the AsyncEngine: prompts in, JSON or SSE out.

One API call becomes a `Call`: its engine requests (prompts x n choices, choice index =
prompt index * n + i) and the wire format to answer in. `respond` collects a whole answer;
`stream` yields server-sent events, one chunk per engine output, then usage and `[DONE]`.

Building a call (JSON decoding, validation, chat template, tokenization) is plain blocking
work: the app runs `completion_call` / `chat_call` in a worker thread, never on the event
loop. A prompt whose UTF-8 length alone proves it cannot fit the context (more bytes than
the context holds tokens times the longest token) is refused before it is tokenized.
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


@dataclass
class Call:
    id: str
    model: str
    format: Format
    requests: list[EngineRequest]
    n: int
    include_usage: bool
    echo_texts: list[str]  # per prompt; empty strings without echo
    stream: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def choices(self) -> dict[str, Choice]:
        return {r.request_id: Choice(i, len(r.prompt_ids), self.echo_texts[i // self.n])
                for i, r in enumerate(self.requests)}


class Serving:
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

    # ---- building calls ---------------------------------------------------------------------

    def completion_call(self, body: bytes) -> Call:
        """The call a /v1/completions body asks for (blocking: run it off the event loop)."""
        req = parse(CompletionRequest, parse_json_body(body))
        model = self.check_model(req.model)
        check_common(req)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)",
                           param="echo")
        prompts = self._completion_prompts(req.prompt)
        echo = [self._prompt_text(p) if req.echo else "" for p in prompts]
        ids = [self._encode(p) for p in prompts]
        structure = self._prepared(structure_of(req))
        return Call(f"cmpl-{uuid.uuid4().hex}", model, CompletionFormat(self.tokenizer),
                    self._engine_requests(req, ids, structure), req.n, req.include_usage,
                    echo, req.stream)

    def chat_call(self, body: bytes) -> Call:
        """The call a /v1/chat/completions body asks for (blocking: run it off the loop)."""
        req = parse(ChatCompletionRequest, parse_json_body(body))
        model = self.check_model(req.model)
        check_common(req)
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        structure = self._chat_structure(req, plan)
        messages, extra = template_messages([m.as_template_dict() for m in req.messages],
                                            plan, self.native_tools)
        self.check_fits(self.tokenizer.apply_chat_template(messages, **extra), "messages")
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **extra)
        chat = ChatFormat(self.tokenizer) if plan is None else ToolFormat(self.tokenizer, plan)
        return Call(f"chatcmpl-{uuid.uuid4().hex}", model, chat,
                    self._engine_requests(req, [ids], self._prepared(structure)), req.n,
                    req.include_usage, [""], req.stream)

    def _chat_structure(self, req: ChatCompletionRequest,
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

    def _prepared(self, found: tuple[Structure, str] | None) -> Structure | None:
        """Compile the structure here (worker thread), so the engine finds it ready."""
        if found is None:
            return None
        structure, param = found
        try:
            self.engine.prepare_structure(structure)
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None
        return structure

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

    @staticmethod
    def _completion_prompts(prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(len(p) == 0 for p in prompt):
            raise ApiError(400, "the prompt is empty; send at least one token", param="prompt")
        return list(prompt)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_fits(prompt, "prompt")
        return self.tokenizer.encode(prompt)

    def _engine_requests(self, req: CompletionRequest | ChatCompletionRequest,
                         prompts: list[list[int]],
                         structure: Structure | None) -> list[EngineRequest]:
        call_id = uuid.uuid4().hex
        out = []
        for p, ids in enumerate(prompts):
            if len(ids) >= self.engine.max_model_len:  # checked here, not on the engine thread
                raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds "
                                    f"{self.engine.max_model_len} (prompt + max_tokens)",
                               param="messages" if isinstance(req, ChatCompletionRequest)
                               else "prompt", code="context_length_exceeded")
            max_tokens = max_tokens_of(req)
            if max_tokens is None:  # as vLLM: whatever the context leaves
                max_tokens = max(1, self.engine.max_model_len - len(ids))
            for i in range(req.n):
                out.append(EngineRequest(f"{call_id}-{p}-{i}", ids,
                                         sampling_params(req, max_tokens, i, structure)))
        return out

    # ---- answering --------------------------------------------------------------------------

    async def respond(self, call: Call, gen: Generation) -> dict[str, Any]:
        """The whole answer as one JSON object."""
        choices = call.choices()
        async for out in gen:
            choices[out.request_id].add(out)
        params = {r.request_id: r.params for r in call.requests}
        body = [call.format.choice(c, params[rid].logprobs) for rid, c in choices.items()]
        return {"id": call.id, "object": call.format.object, "created": call.created,
                "model": call.model, "choices": body,
                "usage": usage(list(choices.values()), call.n), "system_fingerprint": None}

    async def stream(self, call: Call, gen: Generation) -> AsyncIterator[str]:
        """Server-sent events; the Generation is closed however the stream ends."""
        choices = call.choices()
        params = {r.request_id: r.params for r in call.requests}
        try:
            for c in choices.values():
                first = call.format.first_delta(c)
                if first is not None:
                    yield self._event(call, [first])
            async for out in gen:
                c = choices[out.request_id]
                c.last = out
                delta = call.format.delta(c, out, params[out.request_id].logprobs)
                if delta is not None:
                    yield self._event(call, [delta])
            if call.include_usage:
                yield self._event(call, [], usage(list(choices.values()), call.n))
        except EngineStepError as e:  # headers are already sent: report it as an event
            err = ApiError(500, str(e), type_="internal_server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        except EngineUnavailable as e:
            err = ApiError(503, str(e), type_="service_unavailable_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            gen.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _event(call: Call, choices: list[dict[str, Any]],
               use: dict[str, Any] | None = None) -> str:
        chunk: dict[str, Any] = {"id": call.id, "object": call.format.chunk_object,
                                 "created": call.created, "model": call.model,
                                 "choices": choices}
        if call.include_usage:
            chunk["usage"] = use
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
