"""Ollama's wire format: request bodies (strictly typed), `options` as sampling settings,
`format` as a structure, model names, and the `{"error": "..."}` shape of errors.

`options` holds the Modelfile parameters a request may override. kvlab acts on the ones in
`Options` and refuses any other by name (a 400 that lists these), so a client learns that
`mirostat` or `num_gpu` was not applied instead of getting an answer made without it. When a
request leaves them unset, Ollama's runner defaults apply (temperature 0.8, top_k 40,
top_p 0.9), except the repeat penalty: kvlab's spans the whole sequence rather than the last
64 tokens, so it is off unless asked for. `num_ctx` bounds prompt + reply; a prompt that does
not fit is a 400, where Ollama would silently drop the start of the conversation.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvlab.request import SamplingParams, Structure
from kvlab.server.core.bodies import Strict
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving

MAX_STOP = 16  # stop sequences per request
MAX_STOP_CHARS = 1024  # per stop string: the engine scans this much text tail every step
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's runner defaults
UNTIL_CONTEXT_ENDS = (-1, -2)  # num_predict: until the context ends / fill the context


def error_body(err: ApiError) -> dict[str, Any]:
    """Ollama's error shape, which its clients raise as ResponseError(error, status)."""
    return {"error": err.message}


class Options(Strict):
    """The Modelfile parameters kvlab acts on."""

    num_ctx: int | None = None  # a limit on prompt + reply, at most the served context
    num_predict: int | None = None  # reply tokens; -1 until the context ends, -2 fill it
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ToolCallFunction(Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama numbers a reply's calls; kept for a round trip


class ToolCall(Strict):
    function: ToolCallFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # refused: no vision model is served
    thinking: str | None = None  # an earlier reply's reasoning, shown to the template
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # which tool a `tool` message answers

    def as_template_dict(self, i: int) -> dict[str, Any]:
        """The OpenAI-style message `Serving.chat_prompt` renders."""
        if self.images:
            raise ApiError(400, f"messages.{i}.images: the served model reads text only; "
                                "send the message without images", param=f"messages.{i}")
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking:
            m["reasoning_content"] = self.thinking  # the name HF chat templates read
        if self.tool_name:
            m["name"] = self.tool_name
        if self.tool_calls:
            m["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for k, c in enumerate(self.tool_calls)]
        return m


class _Generating(Strict):
    """Fields /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool = True
    format: Any = None  # "json", a JSON schema object, or "" / null for free text
    options: Options | None = None
    keep_alive: float | str | None = None  # accepted: the served model stays loaded anyway
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str | None = None
    system: str | None = None
    template: str | None = None  # refused: kvlab renders the model's own chat template
    suffix: str | None = None  # refused: the served model has no fill-in-the-middle tokens
    context: list[int] | None = None  # an earlier reply's `context`: the ids to continue
    raw: bool | None = None
    images: list[str] | None = None  # refused: no vision model is served


class ShowRequest(Strict):
    model: str = Field(min_length=1)
    verbose: bool | None = None  # true (the vocabulary lists in model_info) is refused


class EmbedRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: float | str | None = None


class EmbeddingsRequest(Strict):
    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None


# ---- names ---------------------------------------------------------------------------------


def ollama_name(serving: Serving) -> str:
    """The served model as Ollama names models: `name:tag`, the tag `latest` by default."""
    name = serving.public_name.removesuffix(".gguf")
    return name if ":" in name else f"{name}:latest"


def check_model(serving: Serving, model: str) -> str:
    """The name to answer with (the one the client sent, as Ollama echoes it); a name the
    server does not answer to is Ollama's 404 "model 'x' not found"."""
    for candidate in dict.fromkeys([model, model.removesuffix(":latest")]):
        try:
            serving.check_model(candidate)
            return model
        except ApiError as e:
            if e.status != 404:
                raise
    if model == ollama_name(serving):
        return model
    raise ApiError(404, f"model '{model}' not found", param="model", type_="not_found_error")


# ---- sampling ------------------------------------------------------------------------------


def check_think(think: bool | str | None) -> bool | None:
    if isinstance(think, str):
        raise ApiError(400, f"think takes true or false here, not the level {think!r}: the "
                            "served model has no thinking levels", param="think")
    return think


def structure_of(value: Any) -> tuple[Structure, str] | None:
    """`format`: "json" (any JSON object) or a JSON schema; "" or null for free text."""
    if value is None or value == "":
        return None
    if value == "json":
        return Structure("json_object"), "format"
    if isinstance(value, dict):
        return Structure("json_schema", json.dumps(value)), "format"
    raise ApiError(400, f"format must be \"json\" or a JSON schema object, got {value!r}",
                   param="format")


def context_limit(serving: Serving, options: Options) -> int:
    """The tokens prompt + reply may take: num_ctx, at most the served context."""
    served = serving.engine.max_model_len
    if options.num_ctx is None:
        return served
    if not 1 <= options.num_ctx <= served:
        raise ApiError(400, f"options.num_ctx must be in [1, {served}] (the served context), "
                            f"got {options.num_ctx}; restart kvlab serve with a larger "
                            "--max-model-len for more", param="options.num_ctx")
    return options.num_ctx


def max_tokens_of(serving: Serving, options: Options, ids: list[int]) -> int:
    """Reply tokens: num_predict, or until the context (num_ctx) ends."""
    limit = context_limit(serving, options)
    if len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds {limit} "
                            "(prompt + reply, options.num_ctx or the served context)",
                       param="options.num_ctx" if options.num_ctx else "prompt")
    room = limit - len(ids)
    n = options.num_predict
    if n is None or n in UNTIL_CONTEXT_ENDS:
        return room
    if n < 1:
        raise ApiError(400, f"options.num_predict must be >= 1, or -1 (until the context "
                            f"ends) / -2 (fill the context), got {n}",
                       param="options.num_predict")
    return min(n, room)


def sampling_params(options: Options, max_tokens: int, structured: Structure | None,
                    logprobs: int | None) -> SamplingParams:
    """Engine settings; raises RequestError (a 400) on values out of range."""
    stop = tuple(options.stop or ())
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"options.stop may list at most {MAX_STOP} sequences of at most "
                            f"{MAX_STOP_CHARS} characters", param="options.stop")

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick(options.temperature, DEFAULTS["temperature"]),
        top_k=int(pick(options.top_k, DEFAULTS["top_k"])),
        top_p=pick(options.top_p, DEFAULTS["top_p"]), min_p=pick(options.min_p, 0.0),
        repetition_penalty=pick(options.repeat_penalty, 1.0),
        presence_penalty=pick(options.presence_penalty, 0.0),
        frequency_penalty=pick(options.frequency_penalty, 0.0), seed=options.seed, stop=stop,
        logprobs=logprobs, structured=structured)


def logprobs_of(req: _Generating) -> int | None:
    """How many alternatives per token to report (None: no logprobs)."""
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise ApiError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}",
                       param="top_logprobs")
    if not req.logprobs:
        if req.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs true", param="top_logprobs")
        return None
    return req.top_logprobs or 0
