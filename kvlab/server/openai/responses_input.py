"""A Responses request's input, from the wire to template messages.

    items_of(input)     a string or a list of items -> validated items in their stored form
                        (each with an id; message content as a list of parts)
    template_messages   items -> OpenAI-style template messages: messages keep their role
                        (developer as system), consecutive `function_call` items become one
                        assistant message's `tool_calls`, a `function_call_output` a `tool`
                        message; `reasoning` items are dropped, as chat templates drop past
                        reasoning
    tool_specs          Responses' flat function tools -> the chat shape `tool_plan` reads

Each item kind is a strict model, so an unknown field is refused by name; images, files and
audio are refused with what the server accepts, since the served models read text only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from kvlab.server.core.bodies import Strict, parse
from kvlab.server.core.errors import ApiError
from kvlab.server.openai.responses_output import new_id

Status = Literal["in_progress", "completed", "incomplete"]
_MEDIA = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


class Part(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts sent back as input carry these
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None
    status: Status | None = None


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: Status | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def parse_at(model: type[BaseModel], value: Any, where: str) -> Any:
    """`parse` for a value inside the body: the error names its place (`input.2.content`)."""
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be a JSON object, got {value!r:.80}", param=where)
    try:
        return parse(model, value)
    except ApiError as e:
        raise ApiError(400, f"{where}: {e.message}",
                       param=f"{where}.{e.param}" if e.param else where) from None


# ---- input -> items ---------------------------------------------------------------------------


def items_of(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's input as stored items: validated, each with an id and a status."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not value:
        raise ApiError(400, "input is empty; send a string or at least one item", param="input")
    return [_item(raw, f"input.{i}") for i, raw in enumerate(value)]


def _item(raw: Any, where: str) -> dict[str, Any]:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if isinstance(raw, dict) and model is None:
        raise ApiError(400, f"{where}.type {kind!r} is not supported; input items may be "
                            f"{', '.join(_ITEMS)}", param=f"{where}.type")
    _refuse_media(raw, where)
    item = parse_at(model or MessageItem, raw, where).model_dump(exclude_none=True)
    item.setdefault("id", new_id(_ID_PREFIX[item["type"]]))
    item.setdefault("status", "completed")
    if item["type"] == "message" and isinstance(item["content"], str):
        part = "output_text" if item["role"] == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    return item


def _refuse_media(raw: Any, where: str) -> None:
    if not isinstance(raw, dict):
        return
    for key in ("content", "output"):
        parts = raw.get(key)
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA:
                raise ApiError(400, f"{where}.{key}.{j} is an {kind} part: this server's "
                                    f"model reads text only, so {_MEDIA[kind]} input is not "
                                    "supported; send input_text parts",
                               param=f"{where}.{key}.{j}.type")


# ---- items -> template messages -------------------------------------------------------------


def template_messages(items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """Chat template messages of a conversation's items; `first_new` is where the request's
    own input starts (errors name its items by their place in `input`)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> the function's name
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            name = names.get(item["call_id"])
            if name is None:
                where = f"input.{i - first_new}.call_id"
                raise ApiError(400, f"no function_call with call_id {item['call_id']!r} comes "
                                    "before this function_call_output", param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "name": name,
                        "content": _text(item["output"])})
    return out


def _text(parts: str | list[dict[str, Any]]) -> str:
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


# ---- tools ------------------------------------------------------------------------------------


def tool_specs(tools: list[Any] | None) -> tuple[list[dict[str, Any]] | None, bool]:
    """(the tools in chat's shape, whether any asks for strict arguments); an empty list is
    no tools, as OpenAI takes it."""
    if not tools:
        return None, False
    specs, strict = [], False
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools.{i} is a {kind!r} tool; this server runs no built-in "
                                "tools (web_search, file_search, code_interpreter, mcp, ...): "
                                "only {\"type\": \"function\", \"name\": ..., \"parameters\": "
                                "{...}} tools, which the client runs", param=f"tools.{i}.type")
        tool = parse_at(FunctionTool, raw, f"tools.{i}")
        function = {"name": tool.name, "description": tool.description or ""}
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        specs.append({"type": "function", "function": function})
        strict = strict or bool(tool.strict)
    return specs, strict


def tool_choice_of(value: Any) -> Any:
    """Responses' tool_choice in chat's shape ({"type": "function", "name"} is flat here)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {
            "type", "name"} and isinstance(value["name"], str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"name\": ...}; built-in tool choices are "
                        f"not supported, got {value!r:.120}", param="tool_choice")
