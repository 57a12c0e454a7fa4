"""Structured outputs and tools at the API, without a model: the request spellings, tool plans,
the generic tool rendering, parsing replies in the families' formats, and tool-call streaming."""

from __future__ import annotations

import json

import pytest

from kvlab.request import Structure
from kvlab.server.core.bodies import parse
from kvlab.server.core.errors import ApiError
from kvlab.server.core.tools import ToolStream, parse_reply, template_messages, tool_plan
from kvlab.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvlab.server.openai.protocol import structure_of as structure_of_request
from kvlab.structured.compiler import closed_schema

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def structure_of(**fields) -> tuple[Structure, str] | None:
    return structure_of_request(parse(CompletionRequest, {"prompt": "x", **fields}))


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA,
                                                                 "strict": True}}},
     "json_schema", "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", "structured_outputs"),
    ({"structured_outputs": {"regex": r"\d+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs"),
    ({"json_schema": SCHEMA}, "json_schema", "json_schema"),
    ({"grammar": 'root ::= "a"'}, "grammar", "grammar"),
])
def test_every_spelling_gives_its_structure(fields: dict, kind: str, param: str) -> None:
    structure, where = structure_of(**fields)
    assert structure.kind == kind and where == param
    if kind == "json_schema":
        assert json.loads(structure.value) == SCHEMA


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"json_schema": [1]}, "json_schema"),
    ({"grammar": ""}, "grammar"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar"),
])
def test_bad_structures_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        structure_of(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_text_format_is_no_structure() -> None:
    assert structure_of(response_format={"type": "text"}) is None
    assert structure_of() is None


def test_tool_plans() -> None:
    assert tool_plan(None, None, None) is None
    assert tool_plan([WEATHER], "none", None) is None
    auto = tool_plan([WEATHER, TIME], None, None)
    assert auto.mode == "auto" and auto.names == {"get_weather", "get_time"}
    assert auto.structure("other") is None  # parsed only, in the family's format
    assert auto.structure("generic").value.startswith("start: calls | TEXT")
    assert auto.structure("qwen").value.startswith("start: (pre call)* TAIL")
    assert '"parameters"' in auto.structure("llama").value
    assert tool_plan([WEATHER], "auto", False).structure("qwen").value.startswith(
        "start: (pre call)? TAIL")
    required = tool_plan([WEATHER, TIME], "required", None)
    schema = json.loads(required.structure("qwen").value)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 2)
    assert json.loads(tool_plan([WEATHER, TIME], "required", False).structure(
        "generic").value)["maxItems"] == 1
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                      None)
    assert named.mode == "required" and named.names == {"get_time"}


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([{"type": "function", "function": {"description": "no name"}}], None,
     "tools.0.function.name"),
    ([{"type": "retrieval"}], None, "tools.0"),
    ([], None, "tools"),
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_bad_tools_are_400(tools, choice, param: str) -> None:
    with pytest.raises(ApiError) as e:
        tool_plan(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param


def test_tools_parse_from_a_chat_body() -> None:
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                        "tools": [WEATHER], "tool_choice": "required",
                                        "parallel_tool_calls": False})
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    assert plan.mode == "required" and not plan.parallel


def test_generic_rendering_of_tools_calls_and_results() -> None:
    plan = tool_plan([WEATHER], "auto", None)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "4 C"},
        {"role": "user", "content": "Thanks"},
    ]
    out, extra = template_messages(messages, plan, native=False)
    assert extra == {} and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather",
                                              "arguments": {"city": "Oslo"}}]
    assert out[3]["content"] == "Result of get_weather: 4 C\n\nThanks"
    native, extra = template_messages(messages, plan, native=True)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("text, content, calls", [
    (('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>'), "Let me check.", [("get_weather", {"city": "Oslo"})]),
    (('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n<tool_call>'
     '{"name": "get_time", "arguments": {}}'), None, [("get_weather", {"city": "A"}),
                                                     ("get_time", {})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ('[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    ('{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}',
     []),
    ("Just an answer.", "Just an answer.", []),
])
def test_replies_parse_in_the_families_formats(text: str, content, calls) -> None:
    got_content, got = parse_reply(text, tool_plan([WEATHER, TIME], "auto", None))
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


def test_tool_stream_sends_text_and_holds_a_call() -> None:
    stream = ToolStream(tool_plan([WEATHER], "auto", None))
    pieces = ["Let me", " check. <tool", "_call>", '{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}', "</tool_call>"]
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    # the space before the call is held, then dropped: the same content as the whole reply's
    assert sent == "Let me check." and rest == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    plain = ToolStream(tool_plan([WEATHER], "auto", None))
    sent = "".join(plain.feed(p) for p in ["The answer ", "is <to", "o small", " {x}"])
    rest, calls = plain.finish()
    assert sent + rest == "The answer is <too small {x}" and calls == []
    required = ToolStream(tool_plan([WEATHER], "required", None))
    assert required.feed('[{"name": "get_weather", "arguments": {"city": "x"}}]') == ""
    assert len(required.finish()[1]) == 1


def test_closing_objects_visits_only_subschemas() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}, "$defs": {"d": {"properties": {"y": {}}}},
        "items": {"properties": {}}, "anyOf": [{"properties": {"z": {}}}]}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property, not a schema
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["items"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed_schema({"properties": {}, "additionalProperties": True})["additionalProperties"]
