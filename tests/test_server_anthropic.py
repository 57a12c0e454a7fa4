"""Anthropic's Messages API: the translation, replies, event stream and errors on a scripted
fake engine (the server's own code runs unchanged around it), then the official `anthropic`
client, unmodified, against `kvlab serve` on the default model."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from test_server import Server, start_server

from kvlab.request import FinishReason, RequestOutput, RequestTimings, SamplingParams, Structure
from kvlab.server.anthropic.protocol import Conversation, template_messages
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.bodies import parse
from kvlab.server.core.guard import ServerLimits
from kvlab.stop import StopStringFilter

from fake_engine import FakeEngine, FakeTokenizer

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")

MODEL = "fake.gguf"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


class ThinkingTokenizer(FakeTokenizer):
    """A tokenizer whose template writes a think block with a switch, and records it."""

    chat_template = "{% if enable_thinking %}{% endif %}<think></think>"

    def __init__(self) -> None:
        self.variables: list[dict] = []

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: object) -> list[int]:
        self.variables.append(variables)
        return super().encode_chat(messages, add_generation_prompt, continue_final_message)


@dataclass
class ScriptedEngine(FakeEngine):
    """Replies with `script`, one character a step, ending there as at EOS; stop strings and
    max_tokens end it as the engine ends it. Records what each request asked for."""

    script: str = "Hello there"
    params: list[SamplingParams] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    structures: list[Structure] = field(default_factory=list)
    stops: dict[str, StopStringFilter] = field(default_factory=dict)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        super().add_request(request_id, prompt, params)
        self.params.append(params)
        self.prompts.append(self.tokenizer.decode(prompt))
        self.stops[request_id] = StopStringFilter(params.stop, params.include_stop_str_in_output)

    def prepare_structure(self, structure: Structure) -> None:
        self.structures.append(structure)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise ValueError("boom")
        outs = []
        for rid, (n_prompt, params, n_out) in list(self.live.items()):
            n_out += 1
            stops = self.stops[rid]
            delta = stops.push(self.script[n_out - 1])
            reason = (FinishReason.STOP if stops.stopped or n_out >= len(self.script) else
                      FinishReason.LENGTH if n_out >= params.max_tokens else None)
            if reason is not None:
                delta += stops.flush()
                del self.live[rid]
            else:
                self.live[rid] = (n_prompt, params, n_out)
            outs.append(RequestOutput(rid, [ord(self.script[n_out - 1])], delta,
                                      reason is not None, reason, n_prompt, 0, n_out,
                                      timings=RequestTimings()))
        return outs


def run_app(engine: FakeEngine, body, limits: ServerLimits | None = None,
            sdk: bool = False) -> None:
    """Run `body(client)` against the app on `engine`, the client an httpx one or (`sdk`)
    the official AsyncAnthropic; afterwards nothing may be held."""
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
        app = create_app(ae, front_ends(), limits=limits or ServerLimits())
        await ae.start()
        try:
            if sdk:  # the client speaks through httpx2, its own fork of httpx
                async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
                    await body(anthropic.AsyncAnthropic(base_url="http://t", api_key="x",
                                                        http_client=http))
            else:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                             base_url="http://t") as client:
                    await body(client)
            for _ in range(200):  # aborts reach the engine thread between its steps
                if not engine.live:
                    break
                await asyncio.sleep(0.01)
            assert ae.num_live == 0 and not engine.live, engine.live
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))


def ask(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Hi"}], **fields}


def events_of(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; each names itself as its data's type."""
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        out.append((payload["type"], payload))
    return out


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def post(engine: FakeEngine, body: dict, path: str = "/v1/messages",
         headers: dict | None = None, limits: ServerLimits | None = None) -> httpx.Response:
    got = []

    async def call(client: httpx.AsyncClient) -> None:
        got.append(await client.post(path, json=body, headers=headers or {}))
    run_app(engine, call, limits)
    return got[0]


# ---- translation ------------------------------------------------------------------------------


def test_a_conversation_becomes_template_messages() -> None:
    conv = parse(Conversation, {"model": MODEL, "system": [
        {"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?",
                                                  "cache_control": {"type": "ephemeral"}}]}]})
    assert template_messages(conv) == [
        {"role": "system", "content": "Be brief. Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather",
         "content": "Error: timeout"},
        {"role": "user", "content": "And tomorrow?"}]


def test_a_plain_message_answers_in_anthropics_shape() -> None:
    engine = ScriptedEngine(script="Hello there")
    r = post(engine, ask(system="Be kind. ", temperature=0, top_k=5, top_p=0.5,
                         metadata={"user_id": "u1"}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("msg_") and body["model"] == MODEL
    assert body == {"id": body["id"], "type": "message", "role": "assistant", "model": MODEL,
                    "content": [{"type": "text", "text": "Hello there"}],
                    "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": len("Be kind. Hi"), "output_tokens": 11,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                              "service_tier": "standard"}}
    assert engine.prompts == ["Be kind. Hi"]
    p = engine.params[0]
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.stop) == (0, 5, 0.5, 64, ())


def test_max_tokens_ends_the_reply_as_max_tokens() -> None:
    body = post(ScriptedEngine(script="Hello there"), ask(max_tokens=4)).json()
    assert body["content"] == [{"type": "text", "text": "Hell"}]
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 4


def test_a_trailing_assistant_turn_is_continued() -> None:
    engine = ScriptedEngine(script=" blue.")
    body = post(engine, ask(messages=[{"role": "user", "content": "Sky colour?"},
                                      {"role": "assistant", "content": "It is"}])).json()
    assert engine.prompts == ["Sky colour?It is"]
    assert body["content"] == [{"type": "text", "text": " blue."}]


@pytest.mark.parametrize("stops, text, matched", [
    (["three", "zz"], "one two ", "three"),
    (["three", "two three"], "one ", "two three"),  # the one that began first
    (["e", "ne"], "o", "ne"),
])
def test_the_stop_sequence_that_matched_is_named_and_cut(stops, text, matched) -> None:
    engine = ScriptedEngine(script="one two three four")
    body = post(engine, ask(stop_sequences=stops)).json()
    assert engine.params[0].stop == tuple(stops)
    assert body["content"] == [{"type": "text", "text": text}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", matched)
    streamed = events_of(post(ScriptedEngine(script="one two three four"),
                              ask(stop_sequences=stops, stream=True)).text)
    deltas = [d["delta"]["text"] for kind, d in streamed if kind == "content_block_delta"]
    assert "".join(deltas) == text
    end = next(d for kind, d in streamed if kind == "message_delta")
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": matched}


def test_a_reply_that_ends_without_a_stop_sequence_names_none() -> None:
    body = post(ScriptedEngine(script="one two"), ask(stop_sequences=["three"])).json()
    assert body["content"] == [{"type": "text", "text": "one two"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)


# ---- streaming --------------------------------------------------------------------------------


def test_the_stream_is_anthropics_event_sequence() -> None:
    r = post(ScriptedEngine(script="Hello"), ask(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    kinds = [kind for kind, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start"] + \
        ["content_block_delta"] * 5 + ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 2 and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello"
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 5


def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    engine = ScriptedEngine(script="Hello", fail_next_step=True)
    events = events_of(post(engine, ask(stream=True)).text)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "boom" in events[-1][1]["error"]["message"]


def test_an_engine_failure_without_a_stream_is_a_500_in_anthropics_shape() -> None:
    r = post(ScriptedEngine(script="Hello", fail_next_step=True), ask())
    assert "boom" in error_of(r, 500, "api_error")


# ---- tools ------------------------------------------------------------------------------------


def test_tool_choice_any_forces_a_call_that_comes_back_as_tool_use() -> None:
    engine = ScriptedEngine(script=CALL)
    body = post(engine, ask(tools=[WEATHER], tool_choice={"type": "any"})).json()
    [use] = body["content"]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert (use["name"], use["input"]) == ("get_weather", {"city": "Paris"})
    assert body["stop_reason"] == "tool_use"
    structure = engine.params[0].structured
    assert structure is not None and structure.kind == "json_schema"
    assert json.loads(structure.value)["maxItems"] == 1  # one tool: at most one call
    assert "get_weather" in engine.prompts[0]  # the tools are shown (generic form)


def test_a_streamed_tool_call_is_a_tool_use_block_with_its_input_as_json() -> None:
    events = events_of(post(ScriptedEngine(script=CALL),
                            ask(tools=[WEATHER], tool_choice={"type": "any"}, stream=True)).text)
    kinds = [kind for kind, _ in events]
    pieces = [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"]
    # the input streams as the model writes it, in fragments that add up to the JSON
    assert kinds == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * len(pieces), "content_block_stop",
                     "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["input"] == {} and block["name"] == "get_weather"
    assert len(pieces) > 2 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_shapes_map_onto_the_plan() -> None:
    other = {**WEATHER, "name": "get_time"}
    named = ScriptedEngine(script=CALL)
    post(named, ask(tools=[WEATHER, other], tool_choice={"type": "tool", "name": "get_weather"}))
    schema = json.loads(named.params[0].structured.value)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {
        "const": "get_weather"}
    single = ScriptedEngine(script=CALL)
    post(single, ask(tools=[WEATHER, other],
                     tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert json.loads(single.params[0].structured.value)["maxItems"] == 1
    both = ScriptedEngine(script=CALL)
    post(both, ask(tools=[WEATHER, other], tool_choice={"type": "any"}))
    assert json.loads(both.params[0].structured.value)["maxItems"] == 2
    none = ScriptedEngine(script="Sunny.")
    body = post(none, ask(tools=[WEATHER], tool_choice={"type": "none"})).json()
    assert none.params[0].structured is None and "get_weather" not in none.prompts[0]
    assert body["content"] == [{"type": "text", "text": "Sunny."}]


def test_auto_text_reply_stays_text() -> None:
    engine = ScriptedEngine(script="It is sunny.")
    body = post(engine, ask(tools=[WEATHER])).json()
    assert body["content"] == [{"type": "text", "text": "It is sunny."}]
    assert body["stop_reason"] == "end_turn"
    assert engine.params[0].structured.kind == "grammar"  # a call is constrained if begun


# ---- thinking ---------------------------------------------------------------------------------


def test_thinking_comes_back_as_a_thinking_block_before_the_text() -> None:
    tok = ThinkingTokenizer()
    script = "<think>\nLet me add.\n</think>\n\nIt is 4."
    engine = ScriptedEngine(script=script, tokenizer=tok)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    body = post(engine, ask(max_tokens=2000, thinking=thinking)).json()
    assert body["content"] == [
        {"type": "thinking", "thinking": "Let me add.", "signature": ""},
        {"type": "text", "text": "It is 4."}]
    assert tok.variables[-1] == {"enable_thinking": True}
    events = events_of(post(ScriptedEngine(script=script, tokenizer=tok),
                            ask(max_tokens=2000, thinking=thinking, stream=True)).text)
    starts = [d["content_block"] for k, d in events if k == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""},
                      {"type": "text", "text": ""}]
    thought = "".join(d["delta"].get("thinking", "") for k, d in events
                      if k == "content_block_delta" and d["index"] == 0)
    text = "".join(d["delta"].get("text", "") for k, d in events
                   if k == "content_block_delta" and d["index"] == 1)
    assert thought.strip() == "Let me add." and text == "It is 4."
    post(ScriptedEngine(script="Hi", tokenizer=tok), ask(thinking={"type": "disabled"}))
    assert tok.variables[-1] == {"enable_thinking": False}
    post(ScriptedEngine(script="Hi", tokenizer=tok), ask(thinking={"type": "adaptive"}))
    assert tok.variables[-1] == {}  # the template's own default


def test_thinking_on_a_model_that_does_not_think_is_refused() -> None:
    r = post(ScriptedEngine(), ask(max_tokens=2000,
                                   thinking={"type": "enabled", "budget_tokens": 1024}))
    assert "does not support thinking" in error_of(r, 400, "invalid_request_error")


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    (ask(frequency_penalty=1.0), "frequency_penalty"),
    (ask(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     "text-only model; image blocks are not supported"),
    (ask(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "document blocks are not supported"),
    (ask(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0"),
    (ask(messages=[{"role": "user", "content": [{"type": "audio", "x": 1}]}]), "audio"),
    (ask(messages=[{"role": "user", "content": [{"text": "no type"}]}]), "type"),
    (ask(messages=[{"role": "system", "content": "Hi"}]), "messages.0.role"),
    (ask(messages=[]), "messages"),
    (ask(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]), "user turn"),
    (ask(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}]), "toolu_9"),
    (ask(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
    (ask(tools=[{**WEATHER, "name": "bad name"}]), "tools.0.name"),
    (ask(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice.name"),
    (ask(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "nope"),
    (ask(tool_choice={"type": "any"}), "no tools"),
    (ask(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 10}), "budget_tokens"),
    (ask(max_tokens=0), "max_tokens"),
    (ask(temperature=1.5), "temperature"),
    (ask(stop_sequences=[""]), "stop_sequences.0"),
    (ask(metadata={"user_id": "u", "session": "s"}), "metadata.session"),
])
def test_bad_bodies_are_400_naming_the_problem(body, words) -> None:
    engine = ScriptedEngine()
    assert words in error_of(post(engine, body), 400, "invalid_request_error")
    assert not engine.params  # nothing reached the engine


def test_bad_json_and_unknown_model() -> None:
    async def call(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/messages", content=b"{not json")
        assert "JSON" in error_of(r, 400, "invalid_request_error")
        r = await client.post("/v1/messages", json=ask(model="claude-opus-4"))
        assert "claude-opus-4" in error_of(r, 404, "not_found_error")
        r = await client.post("/v1/messages/count_tokens",
                              json={"model": "nope", "messages": [{"role": "user",
                                                                   "content": "x"}]})
        error_of(r, 404, "not_found_error")
    run_app(ScriptedEngine(), call)


def test_the_guard_answers_in_anthropics_shape() -> None:
    limits = ServerLimits(api_key="secret", max_request_bytes=2048)
    r = post(ScriptedEngine(), ask(), headers={"x-api-key": "wrong"}, limits=limits)
    assert "API key" in error_of(r, 401, "authentication_error")
    r = post(ScriptedEngine(), ask(), headers={"x-api-key": "secret"}, limits=limits)
    assert r.status_code == 200, r.text
    big = ask(messages=[{"role": "user", "content": "x" * 4000}])
    r = post(ScriptedEngine(), big, headers={"x-api-key": "secret"}, limits=limits)
    assert "too large" in error_of(r, 413, "request_too_large")


def test_count_tokens_counts_the_prompt_messages_would_run() -> None:
    engine = ScriptedEngine(script="ok")
    conv = {"model": MODEL, "system": "Sys. ", "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather?"}]}
    r = post(engine, conv, path="/v1/messages/count_tokens")
    assert r.status_code == 200, r.text
    body = post(engine, {**conv, "max_tokens": 8}).json()
    assert r.json() == {"input_tokens": body["usage"]["input_tokens"]}
    assert r.json()["input_tokens"] == len(engine.prompts[0])
    error_of(post(engine, {**conv, "max_tokens": 8}, path="/v1/messages/count_tokens"), 400,
             "invalid_request_error")  # count_tokens takes no sampling fields


def test_the_official_client_reads_thinking_and_tool_use_streams() -> None:
    """The client's own stream accumulator over the app: blocks, inputs and stop reasons."""
    script = "<think>Add them.</think>\n\nIt is 4."
    think = {"type": "enabled", "budget_tokens": 1024}

    async def thinking(sdk: anthropic.AsyncAnthropic) -> None:
        async with sdk.messages.stream(model=MODEL, max_tokens=2000, messages=[
                {"role": "user", "content": "2 + 2?"}], thinking=think) as stream:
            final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "Add them." and final.content[1].text == "It is 4."
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(script)
    run_app(ScriptedEngine(script=script, tokenizer=ThinkingTokenizer()), thinking, sdk=True)

    async def tool_use(sdk: anthropic.AsyncAnthropic) -> None:
        async with sdk.messages.stream(model=MODEL, max_tokens=64, tools=[WEATHER],
                                       tool_choice={"type": "any"}, messages=[
                                           {"role": "user", "content": "Paris?"}]) as stream:
            final = await stream.get_final_message()
        [use] = final.content
        assert use.type == "tool_use" and use.input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"
    run_app(ScriptedEngine(script=CALL), tool_use, sdk=True)


# ---- the official client against kvlab serve --------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log, "--max-num-seqs", "4") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


USER = [{"role": "user", "content": "Name three colors."}]
# long enough to fill whole KV blocks, which the prefix cache keeps
SYSTEM = "You answer questions about colours, paint and light in one short line. " * 6
GREEDY = {"temperature": 0}  # this client version sends sampling settings only as extra_body


@pytest.mark.slow
def test_client_create_and_stream(client) -> None:
    made = client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=16,
                                  extra_body=GREEDY, messages=USER, system=SYSTEM)
    assert made.type == "message" and made.stop_reason in ("end_turn", "max_tokens")
    assert made.content[0].type == "text" and made.content[0].text
    assert made.usage.output_tokens > 0 and made.usage.input_tokens > 0
    with client.messages.stream(model="gemma-3-270m-q4_k_m.gguf", max_tokens=16,
                                extra_body=GREEDY, messages=USER, system=SYSTEM) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == made.content[0].text  # greedy: the same reply
    assert final.stop_reason == made.stop_reason
    total = made.usage.input_tokens + made.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: a prefix hit
    count = client.messages.count_tokens(model="gemma-3-270m-q4_k_m.gguf", messages=USER,
                                         system=SYSTEM)
    assert count.input_tokens == total


@pytest.mark.slow
def test_client_stop_sequence(client) -> None:
    made = client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=24,
                                  extra_body=GREEDY, messages=USER)
    text = made.content[0].text
    stop = next(w for w in reversed(text.split()) if text.index(w) > 0)
    cut = client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=24,
                                 extra_body=GREEDY, messages=USER,
                                 stop_sequences=["never seen", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert [b.text for b in cut.content] == [text[:text.index(stop)]]


@pytest.mark.slow
def test_client_tool_use_round_trip(client) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    made = client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=64,
                                  extra_body=GREEDY, messages=question, tools=[WEATHER],
                                  tool_choice={"type": "any"})
    assert made.stop_reason == "tool_use"
    [use] = [b for b in made.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    assert use.id.startswith("toolu_")
    answer = client.messages.create(
        model="gemma-3-270m-q4_k_m.gguf", max_tokens=16, extra_body=GREEDY, tools=[WEATHER],
        messages=[*question, {"role": "assistant", "content": made.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 24 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    def prompt(m):
        return m.usage.input_tokens + m.usage.cache_read_input_tokens

    assert answer.content and prompt(answer) > prompt(made)  # the call and result were shown


@pytest.mark.slow
def test_client_errors_raise_the_clients_exceptions(client) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=8, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.BadRequestError, match="does not support thinking"):
        client.messages.create(model="gemma-3-270m-q4_k_m.gguf", max_tokens=2048,
                               messages=USER,
                               thinking={"type": "enabled", "budget_tokens": 1024})


@pytest.mark.slow
def test_a_stream_the_client_leaves_frees_its_request(server, client) -> None:
    with client.messages.stream(model="gemma-3-270m-q4_k_m.gguf", max_tokens=400,
                                messages=USER) as stream:
        next(iter(stream.text_stream))  # leave after the first text
    for _ in range(100):  # the abort reaches the engine between two of its steps
        if server.health()["num_requests"] == 0:
            break
        time.sleep(0.1)
    assert server.health()["num_requests"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    aborted = re.search(r'request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                        metrics)
    assert aborted and float(aborted.group(1)) >= 1, metrics  # ended by the abort, not by EOS
