"""Code completion between a prefix and a suffix: llama.cpp's /infill, and `suffix` on
/v1/completions. Both build the FIM prompt of kvlab.server.core.infill.

    /infill   {"input_prefix"?, "input_suffix"?, "input_extra"?: [{"filename"?, "text"}],
               "prompt"?, "n_predict"?, "temperature"?, "top_k"?, "top_p"?, "seed"?, "stop"?,
               "stream"?, "model"?}
              -> {"index", "content", "tokens", "stop": true, "model", "tokens_predicted",
                  "tokens_evaluated", "tokens_cached", "truncated", "stop_type",
                  "stopping_word", "timings"}, as llama-server writes it
    stream    `data: {...}` events: content deltas with "stop": false, then that final object
              with empty content (llama-server's /infill sends no [DONE])

`prompt` is what the user has typed on the current line before the cursor: it ends the prefix
(where llama-server puts it), so the middle the model writes begins at the cursor. Sampling defaults are llama-server's (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05; n_predict -1: until the model ends the middle or the context is
full; seed -1: random). `stop_type` is "eos" (the model ended), "word" (a stop string, named
in `stopping_word` and left out of the content), "limit" (n_predict or the context) or
"none" (aborted). Errors keep the OpenAI shape, as on llama-server's other routes here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from kvlab.request import FinishReason, RequestOutput, RequestTimings, SamplingParams
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
from kvlab.server.core.infill import FimChunk, infill_prompt, reply_room
from kvlab.server.core.serving import Serving
from kvlab.server.openai.protocol import MAX_STOP, MAX_STOP_CHARS, CompletionRequest, max_tokens_of

MAX_EXTRA_FILES = 64  # context files per request


class InfillRequest(Strict):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[FimChunk] = Field(default_factory=list, max_length=MAX_EXTRA_FILES)
    prompt: str = ""
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = -1
    stop: list[str] | str = Field(default_factory=list)
    stream: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def completion_ids(serving: Serving, req: CompletionRequest,
                   prompt: str | list[int]) -> list[int]:
    """The ids of one /v1/completions prompt; with a `suffix`, the prompt is the prefix of a
    FIM prompt (cut, where it must be, to leave max_tokens of the context free)."""
    if req.suffix is None:
        return serving.encode(prompt)
    room = reply_room(serving, max_tokens_of(req))
    return infill_prompt(serving, prompt, req.suffix, reply=room,
                         params=("prompt", "suffix")).ids


def _sampling(req: InfillRequest, max_tokens: int) -> SamplingParams:
    stops = req.stops
    if len(stops) > MAX_STOP or max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise ApiError(400, f"stop may list at most {MAX_STOP} strings of at most "
                            f"{MAX_STOP_CHARS} characters", param="stop")
    # the stop string stays in the engine's text so the answer can name it (stopping_word)
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                          top_p=req.top_p, min_p=0.05, seed=None if req.seed == -1 else req.seed,
                          stop=stops, include_stop_str_in_output=True)


def _n_predict(req: InfillRequest) -> int | None:
    if req.n_predict == -1:
        return None
    if req.n_predict < 1:
        raise ApiError(400, f"n_predict must be -1 (until the model ends the middle or the "
                            f"context is full) or at least 1, got {req.n_predict}",
                       param="n_predict")
    return req.n_predict


@dataclass
class Ending:
    """How the reply ended, in llama-server's words."""

    stop_type: str = "none"
    stopping_word: str = ""


@dataclass
class InfillCall(EngineCall):
    """One /infill call: built from its body, submitted to the engine, answered."""

    engine: AsyncEngine
    model: str
    request: EngineRequest
    eos_ids: frozenset[int]
    truncated: bool
    stream: bool = False
    media_type: ClassVar[str] = "text/event-stream"
    gen: Generation | None = field(default=None, init=False)

    @classmethod
    def build(cls, serving: Serving, body: bytes) -> InfillCall:
        """The call an /infill body asks for (blocking: run it off the event loop)."""
        req = parse(InfillRequest, parse_json_body(body))
        model = serving.check_model(req.model)
        n_predict = _n_predict(req)
        prompt = infill_prompt(serving, req.input_prefix, req.input_suffix, prompt=req.prompt,
                               extra=req.input_extra, reply=reply_room(serving, n_predict))
        max_tokens = n_predict or serving.default_max_tokens(prompt.ids)
        [request] = serving.engine_requests([prompt.ids], [_sampling(req, max_tokens)], "prompt",
                                            chat=False)
        stop_ids = frozenset(serving.tokenizer.eos_ids)
        return cls(serving.engine, model, request, stop_ids, prompt.truncated, req.stream)

    def engine_requests(self) -> list[EngineRequest]:
        return [self.request]

    async def respond(self) -> dict[str, Any]:
        """The whole answer as one JSON object."""
        text: list[str] = []
        tokens: list[int] = []
        last, ending = None, Ending()
        async for out in self.submitted():
            delta, ending = self._read(out)
            text.append(delta)
            tokens += out.new_token_ids
            last = out
        assert last is not None
        return self._final(last, ending, "".join(text), tokens)

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events; the call is closed however the stream ends."""
        try:
            async for out in self.submitted():
                delta, ending = self._read(out)
                if delta or out.new_token_ids:
                    yield _event(self._partial(out, delta))
                if out.finished:
                    yield _event(self._final(out, ending, "", []))
        except (EngineStepError, EngineUnavailable) as e:  # headers are sent: an error event
            status, kind = ((500, "internal_server_error") if isinstance(e, EngineStepError)
                            else (503, "service_unavailable_error"))
            yield _event(ApiError(status, str(e), type_=kind).body())
        finally:
            self.close()

    def _read(self, out: RequestOutput) -> tuple[str, Ending]:
        """The output's text for the client, and how the reply ended if it did."""
        if not out.finished:
            return out.text_delta, Ending()
        if out.finish_reason == FinishReason.LENGTH:
            return out.text_delta, Ending("limit")
        if out.finish_reason != FinishReason.STOP:
            return out.text_delta, Ending()
        if out.new_token_ids and out.new_token_ids[-1] in self.eos_ids:
            return out.text_delta, Ending("eos")
        stops = sorted(self.request.params.stop, key=len, reverse=True)
        word = next((s for s in stops if out.text_delta.endswith(s)), None)
        if word is None:  # a stop token id or a finished structure: the model ended
            return out.text_delta, Ending("eos")
        return out.text_delta[:len(out.text_delta) - len(word)], Ending("word", word)

    def _partial(self, out: RequestOutput, content: str) -> dict[str, Any]:
        return {"index": 0, "content": content, "tokens": out.new_token_ids, "stop": False,
                "tokens_predicted": out.output_tokens, "tokens_evaluated": out.prompt_tokens}

    def _final(self, out: RequestOutput, ending: Ending, content: str,
               tokens: list[int]) -> dict[str, Any]:
        return {"index": 0, "content": content, "tokens": tokens, "stop": True,
                "model": self.model, "tokens_predicted": out.output_tokens,
                "tokens_evaluated": out.prompt_tokens, "tokens_cached": out.cached_tokens,
                "truncated": self.truncated, "stop_type": ending.stop_type,
                "stopping_word": ending.stopping_word,
                "timings": timings(out, out.timings or RequestTimings())}


def timings(out: RequestOutput, t: RequestTimings) -> dict[str, Any]:
    """llama-server's timings object: prompt (prefill) and predicted (decode) rates."""
    prompt_n = out.prompt_tokens - out.cached_tokens
    prompt_ms = t.prefill_seconds * 1e3
    predicted_ms = ((t.finished or t.first_token or 0.0) - (t.first_token or 0.0)) * 1e3
    return {"cache_n": out.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            **_rates("prompt", prompt_n, prompt_ms), "predicted_n": out.output_tokens,
            "predicted_ms": predicted_ms, **_rates("predicted", out.output_tokens, predicted_ms)}


def _rates(name: str, n: int, ms: float) -> dict[str, float]:
    return {f"{name}_per_token_ms": ms / n if n else 0.0,
            f"{name}_per_second": 1e3 * n / ms if ms > 0 else 0.0}


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
