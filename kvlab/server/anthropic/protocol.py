"""Anthropic's Messages wire format: request bodies (strictly typed), their translation onto the
server's one conversation form, and the error body.

    system                  -> a system message (its text blocks joined)
    user turn               -> each tool_result block a `role: tool` message (tool_call_id and
                               the name of the tool_use it answers), its text blocks user text
    assistant turn          -> text, tool_use blocks as `tool_calls`, thinking blocks as
                               `reasoning_content` (templates that show past reasoning read it)
    a final assistant turn  -> a prefill: the reply continues it (`Serving.chat_prompt`)
    tools / tool_choice     -> OpenAI function tools and tool_choice, for `tool_plan`
                               (auto, any -> required, tool -> named, none)

Image and document blocks are refused by name: the server serves text-only models. Any other
field kvlab does not act on is a 400 naming it (`Strict`). `cache_control` (top level or on a
block) is accepted: kvlab caches every prompt prefix by itself, so a breakpoint asks for
nothing it does not do. Thinking "adaptive" leaves it to the model (its template's default).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from kvlab.request import SamplingParams, Structure
from kvlab.server.core.bodies import Strict
from kvlab.server.core.errors import ApiError

MAX_STOP_SEQUENCES = 16  # the engine scans each one over the text's tail every step
MAX_STOP_CHARS = 1024
MIN_THINKING_BUDGET = 1024  # Anthropic's minimum budget_tokens
_MEDIA = ("image", "document")
# status -> Anthropic's error type (its SDK picks the exception from the status)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                            else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class CacheControl(Strict):
    type: Literal["ephemeral"]


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # a reply's text block sent back as it came (kvlab cites nothing)


class MediaBlock(BaseModel):
    """An image or document: parsed only to be refused by name, whatever its source."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


TextOrMedia = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


def _as_blocks(value: Any) -> Any:
    """A plain string stands for one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):  # pydantic reports a ValueError, not a TypeError
        raise ValueError("must be a string or a list of content blocks")  # noqa: TRY004
    return value


T = TypeVar("T")
Blocks = Annotated[list[T], BeforeValidator(_as_blocks)]  # content: a string or blocks


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Blocks[TextOrMedia] = Field(default_factory=list)
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str


Block = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Blocks[Block]


class Tool(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is one of Anthropic's server tools; this "
                             "server takes custom tools only ({name, description, "
                             "input_schema}), which the client runs")
        return value


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: as the model's template does
    budget_tokens: int | None = None


class Metadata(Strict):
    user_id: str | None = None  # who the caller's end user is; nothing here depends on it


class Conversation(Strict):
    """What decides the prompt: the body of /v1/messages/count_tokens, and the core of
    /v1/messages."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: Blocks[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier: standard


# ---- onto the server's conversation form ------------------------------------------------------


def template_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The OpenAI-style template messages of a conversation (see the module docstring)."""
    out = [{"role": "system", "content": _joined(conv.system, "system")}] if conv.system else []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer it
    for i, message in enumerate(conv.messages):
        where = f"messages.{i}.content"
        if message.role == "assistant":
            out.append(_assistant(message.content, where, names))
        else:
            out += _user(message.content, where, names)
    return out


def _assistant(blocks: list[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    text, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock | MediaBlock):
            text.append(_text_of(block, f"{where}.{j}"))
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        else:
            raise ApiError(400, f"{where}.{j}: a {block.type} block belongs in a user turn, "
                                "not an assistant one", param=f"{where}.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _user(blocks: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """Tool results and text in their order; adjacent text blocks make one user message."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        here = f"{where}.{j}"
        if isinstance(block, ToolResultBlock):
            out.append(_tool_result(block, here, names))
        elif isinstance(block, TextBlock | MediaBlock):
            text = _text_of(block, here)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        else:
            raise ApiError(400, f"{here}: a {block.type} block belongs in an assistant turn, "
                                "not a user one", param=here)
    return out or [{"role": "user", "content": ""}]


def _tool_result(block: ToolResultBlock, where: str, names: dict[str, str]) -> dict[str, Any]:
    name = names.get(block.tool_use_id)
    if name is None:
        raise ApiError(400, f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use "
                            "block of an earlier assistant turn", param=f"{where}.tool_use_id")
    text = _joined(block.content, f"{where}.content")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "name": name,
            "content": f"Error: {text}" if block.is_error else text}


def _joined(blocks: list[Any], where: str) -> str:
    return "".join(_text_of(b, f"{where}.{j}") for j, b in enumerate(blocks))


def _text_of(block: TextBlock | MediaBlock, where: str) -> str:
    if isinstance(block, MediaBlock):
        raise ApiError(400, f"{where}: this server serves a text-only model; {block.type} "
                            "blocks are not supported (send text blocks)", param=where)
    return block.text


def openai_tools(conv: Conversation) -> list[dict[str, Any]] | None:
    """The tools in the OpenAI function shape `tool_plan` reads."""
    if conv.tools is None:
        return None
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in conv.tools]


def openai_tool_choice(conv: Conversation) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel calls allowed) for `tool_plan`."""
    choice = conv.tool_choice
    if choice is None:
        return None, None
    parallel = (None if choice.disable_parallel_tool_use is None
                else not choice.disable_parallel_tool_use)
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "tool_choice.name is required when tool_choice.type is "
                                "\"tool\"", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.name is not None:
        raise ApiError(400, f"tool_choice.name goes with type \"tool\" only, not "
                            f"{choice.type!r}", param="tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def thinking_switch(conv: Conversation, max_tokens: int | None) -> bool | None:
    """Whether the request asks the model to think (None: it does not say), with
    Anthropic's checks on the budget. The budget ends the reasoning by forcing its end
    marker (Serving.reasoning_gate)."""
    thinking = conv.thinking
    if thinking is None:
        return None
    budget = thinking.budget_tokens
    if thinking.type != "enabled":
        if budget is not None:
            raise ApiError(400, "thinking.budget_tokens goes with type \"enabled\" only",
                           param="thinking.budget_tokens")
        return None if thinking.type == "adaptive" else False
    if budget is None or budget < MIN_THINKING_BUDGET:
        raise ApiError(400, f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET}, got "
                            f"{budget}", param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                            f"({max_tokens})", param="thinking.budget_tokens")
    return True


def sampling_params(req: MessagesRequest, structure: Structure | None) -> SamplingParams:
    """Engine settings; stop sequences come back in the text, so the reply can say which
    one matched (it is cut off there)."""
    stops = tuple(req.stop_sequences or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"stop_sequences may list at most {MAX_STOP_SEQUENCES}, got "
                            f"{len(stops)}", param="stop_sequences")
    for k, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise ApiError(400, f"stop_sequences.{k} must be 1 to {MAX_STOP_CHARS} characters, "
                                f"got {len(stop)}", param=f"stop_sequences.{k}")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise ApiError(400, f"temperature must be in [0, 1], got {req.temperature}",
                       param="temperature")
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=stops,
        include_stop_str_in_output=bool(stops), structured=structure)
