"""OpenAI completions and chat completions on the AsyncEngine: prompts in, JSON or SSE out.

One API call becomes a `Call`: its engine requests (prompts x n choices, choice index =
prompt index * n + i) and the wire format to answer in. `respond` collects a whole answer;
`stream` yields server-sent events, one chunk per engine output, then usage and `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvlab.server.async_engine import AsyncEngine, EngineRequest, EngineStepError, Generation
from kvlab.server.formats import ChatFormat, Choice, CompletionFormat, Format, usage
from kvlab.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    max_tokens_of,
    sampling_params,
)


@dataclass
class Call:
    id: str
    model: str
    format: Format
    requests: list[EngineRequest]
    n: int
    include_usage: bool
    echo_texts: list[str]  # per prompt; empty strings without echo
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

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return self.engine.model_name

    # ---- building calls ---------------------------------------------------------------------

    def completion_call(self, req: CompletionRequest) -> Call:
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
        return Call(f"cmpl-{uuid.uuid4().hex}", model, CompletionFormat(self.tokenizer),
                    self._engine_requests(req, ids), req.n, req.include_usage, echo)

    def chat_call(self, req: ChatCompletionRequest) -> Call:
        model = self.check_model(req.model)
        check_common(req)
        messages = [m.as_template_dict() for m in req.messages]
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return Call(f"chatcmpl-{uuid.uuid4().hex}", model, ChatFormat(self.tokenizer),
                    self._engine_requests(req, [ids]), req.n, req.include_usage, [""])

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
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _engine_requests(self, req: CompletionRequest | ChatCompletionRequest,
                         prompts: list[list[int]]) -> list[EngineRequest]:
        call_id = uuid.uuid4().hex
        out = []
        for p, ids in enumerate(prompts):
            max_tokens = max_tokens_of(req)
            if max_tokens is None:  # as vLLM: whatever the context leaves
                max_tokens = max(1, self.engine.max_model_len - len(ids))
            for i in range(req.n):
                out.append(EngineRequest(f"{call_id}-{p}-{i}", ids,
                                         sampling_params(req, max_tokens, seed_offset=i)))
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
