"""The OpenAI wire format: request bodies (strictly typed), errors, and their sampling settings.

Bodies are validated in pydantic's strict mode, so `"max_tokens": "5"` is a 400 as on
api.openai.com rather than a silent cast. A field the server does not act on is a 400 that
names it and lists the fields it does (a client learns its setting was not applied, instead of
getting an answer made without it); vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...) are
understood, so `extra_body=` from the official client reaches the sampler.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from kvlab.request import SamplingParams, Structure
from kvlab.server.core.bodies import Strict
from kvlab.server.core.errors import ApiError

MAX_N = 16  # choices per request (OpenAI allows 128; each is a sequence in the batch)
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' `logprobs`, as OpenAI bounds it
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs`, as OpenAI bounds it
MAX_STOP = 4  # stop sequences, as OpenAI bounds them
MAX_STOP_CHARS = 1024  # per stop string: the engine scans this much text tail every step
MAX_STOP_TOKEN_IDS = 256


class StreamOptions(Strict):
    include_usage: bool = False


class _Sampling(Strict):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: Any = None  # OpenAI: {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: Any = None  # vLLM: {"json" | "regex" | "choice" | "grammar": ...}
    json_schema: Any = None  # llama.cpp's server
    grammar: Any = None  # llama.cpp's server (GBNF)
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ... pass through
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {**(self.model_extra or {}), "role": role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: continue the final assistant message / open a new turn after it; unset, a
    # trailing assistant message is continued (a prefill of the reply)
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. enable_thinking
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & _TEMPLATE_OWN)
        if taken:
            raise ValueError(f"{taken[0]!r} is set by the server, not by chat_template_kwargs")
        return value


# template variables the server itself sets from the request
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "continue_final_message",
                 "bos_token", "eos_token"}


def check_common(req: _Sampling) -> None:
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop may list at most {MAX_STOP} sequences, got {len(stops)}",
                       param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(400, f"a stop sequence may be at most {MAX_STOP_CHARS} characters, "
                            f"got {longest}", param="stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids, got "
                            f"{len(req.stop_token_ids)}", param="stop_token_ids")


def requested_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top alternatives the engine must report per token (None: no logprobs)."""
    if isinstance(req, CompletionRequest):
        n, param, most = req.logprobs, "logprobs", MAX_COMPLETION_LOGPROBS
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true",
                           param="top_logprobs")
        n, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
        most = MAX_TOP_LOGPROBS
    if n is not None and not 0 <= n <= most:
        raise ApiError(400, f"{param} must be in [0, {most}], got {n}", param=param)
    return n


def max_tokens_of(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def structure_of(req: _Sampling) -> tuple[Structure, str] | None:
    """(structure, the field that gave it) a request asks its output to follow, in any of
    the spellings clients use (OpenAI's response_format, vLLM's structured_outputs,
    llama.cpp's json_schema and grammar); more than one is a 400."""
    found = [(param, s) for param, s in (
        ("response_format", _response_format(req.response_format)),
        ("structured_outputs", _structured_outputs(req.structured_outputs)),
        ("json_schema", _schema(req.json_schema, "json_schema")),
        ("grammar", _text(req.grammar, "grammar", "grammar"))) if s is not None]
    if len(found) > 1:
        raise ApiError(400, f"give one structure, not {' and '.join(p for p, _ in found)}",
                       param=found[1][0])
    return (found[0][1], found[0][0]) if found else None


def _response_format(value: Any) -> Structure | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        if value.get("schema") is not None:
            return _schema(value["schema"], "response_format.schema")
        return Structure("json_object")
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        return _schema(value["json_schema"].get("schema"), "response_format.json_schema.schema")
    raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": "
                        "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                        "{\"name\": ..., \"schema\": {...}}}", param="response_format")


def _structured_outputs(value: Any) -> Structure | None:
    if value is None:
        return None
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object")
            if isinstance(value, dict) and value.get(k) is not None]
    if len(keys) != 1:
        raise ApiError(400, "structured_outputs must give exactly one of json, regex, choice, "
                            "grammar or json_object", param="structured_outputs")
    key, item = keys[0], value[keys[0]]
    param = f"structured_outputs.{key}"
    if key == "json":
        return _schema(json.loads(item) if isinstance(item, str) and _is_json(item) else item,
                       param)
    if key == "choice":
        if not isinstance(item, list) or not item or not all(
                isinstance(c, str) and c for c in item):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings",
                           param=param)
        return Structure("choice", json.dumps(item))
    if key == "json_object":
        return Structure("json_object")
    return _text(item, "regex" if key == "regex" else "grammar", param)


def _schema(value: Any, param: str) -> Structure | None:
    if value is None:
        return None
    if not isinstance(value, (dict, bool)):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    return Structure("json_schema", json.dumps(value))


def _text(value: Any, kind: str, param: str) -> Structure | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    return Structure(kind, value)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    seed_offset: int = 0, structured: Structure | None = None) -> SamplingParams:
    """Engine settings for one choice; raises RequestError on values out of range."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick(req.temperature, 1.0),
        top_p=pick(req.top_p, 1.0), top_k=req.top_k or 0, min_p=pick(req.min_p, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0),
        presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        seed=None if req.seed is None else req.seed + seed_offset, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        logprobs=requested_logprobs(req),
        include_stop_str_in_output=req.include_stop_str_in_output, structured=structured,
        logit_bias=_logit_bias(req.logit_bias))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} with its keys as ids; a key that is no id is an error."""
    bad = [k for k in bias or {} if not k.strip().lstrip("-").isdigit()]
    if bad:
        raise ApiError(400, f"logit_bias keys must be token ids (integers, as strings), "
                            f"got {bad[0]!r}", param="logit_bias")
    return {int(k): v for k, v in (bias or {}).items()}
