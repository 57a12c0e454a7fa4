"""Structured outputs and tool calls through `kvlab serve`, driven by the official `openai`
client: JSON schema and object replies, n > 1, required / named / auto tool calls (auto on a
Qwen-format template), streaming tool-call deltas, a tool-result turn, and 400s that name the
field while the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server import MODEL, start_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
QWEN_TEMPLATE = Path(__file__).parent / "data" / "qwen_tools.jinja"

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000}},
    "required": ["city", "population"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log) as server:
        yield server.client()


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-qwen") / "serve.log"
    with start_server(log, "--chat-template", str(QWEN_TEMPLATE)) as server:
        yield server.client()


def args_of(call) -> dict:
    return json.loads(call.function.arguments)


def test_json_schema_and_object_replies(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "A big city, as JSON."}], response_format=fmt,
        max_tokens=60, n=2, temperature=1.0, seed=5)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert r.usage.completion_tokens_details.forced_tokens > 0
    c = client.completions.create(model=MODEL, prompt="A city as JSON:", max_tokens=60,
                                  temperature=0, extra_body={"json_schema": SCHEMA})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


def test_required_and_named_tool_calls(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=100, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(args_of(call), tool["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=100, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(args_of(call)) == {"zone"}


def test_streamed_tool_calls_and_a_tool_result_turn(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                            tool_choice="required", max_tokens=100,
                                            temperature=0, stream=True)
    calls, reasons = {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": calls[0]["id"], "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_auto_on_a_qwen_template_shows_the_tools(qwen_client) -> None:
    plain = qwen_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                temperature=0)
    auto = qwen_client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                               max_tokens=40, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the <tools> block
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = qwen_client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=80,
                                                 temperature=0)
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"extra_body": {"grammar": "root ::= undefined_rule"}}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "nameless"}}]},
     "tools.0.function.name"),
])
def test_bad_structures_and_tools_are_400(client, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
