"""OpenAI's Responses API (/v1/responses): on the app with a scripted fake engine and the default
model's real tokenizer and chat template (input translation, the store's bounds, event order
and numbering, tool calls and reasoning as items, bad bodies, nothing held afterwards), then
end to end through `kvlab serve` on the default model with the official `openai` client."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pydantic
import pytest
from test_server import start_server
from test_tokenizer_gemma import default_tokenizer

from kvlab.errors import KvlabError
from kvlab.request import (
    SamplingParams,
    Structure,
)
from kvlab.server.core.guard import ServerLimits
from kvlab.server.core.reasoning import ReasoningFormat
from kvlab.server.openai.responses_input import items_of, template_messages
from kvlab.server.openai.responses_output import Reply
from kvlab.server.openai.responses_store import ResponseStore, StoredResponse
from kvlab.structured.compiler import GrammarCompiler

from fake_engine import FakeEngine, FakeTokenizer, run_on_app

openai = pytest.importorskip("openai")

MODEL = "gemma-3-270m-q4_k_m.gguf"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL_TEXT = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@dataclass
class ScriptedEngine(FakeEngine):
    """The fake engine (writing its `reply`, a character a step), keeping every prompt and
    sampling setting it was given and compiling structures as the engine does."""

    prompts: dict[str, list[int]] = field(default_factory=dict)
    params: dict[str, SamplingParams] = field(default_factory=dict)
    compiler: GrammarCompiler | None = None

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        super().add_request(request_id, prompt, params)
        self.prompts[request_id], self.params[request_id] = list(prompt), params

    def prepare_structure(self, structure: Structure) -> None:
        """The real compiler, so a structure it cannot use is refused as the engine does."""
        if self.compiler is None:
            self.compiler = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)
        self.compiler.compile(structure)


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def run_app(tok, body, script: str = "", limits: ServerLimits | None = None,
            max_model_len: int = 4096) -> None:
    """Run `body(client, app, engine)` on the app; afterwards no request may be held."""
    engine = ScriptedEngine(model_name=MODEL, tokenizer=tok, reply=script,
                            max_model_len=max_model_len)
    run_on_app(engine, lambda client, app: body(client, app, engine), limits)


def events_of(text: str) -> list[dict]:
    """The SSE stream's events; each `event:` line names its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- input translation ----------------------------------------------------------------------


def test_items_become_template_messages() -> None:
    items = items_of([
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "I should call the tool."}]},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sun"}])
    assert all(i["id"] and i["status"] == "completed" for i in items)
    assert items[0]["content"] == [{"type": "input_text", "text": "Be terse."}]
    assert items[3]["content"] == [{"type": "output_text", "text": "Let me look."}]
    calls = [{"id": f"call_{n}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}
        for n, city in ((1, "Paris"), (2, "Rome"))]
    assert template_messages(items, 0) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather now?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sun"}]
    (hi,) = items_of("hi")
    assert hi == {"id": hi["id"], "status": "completed", "type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "hi"}]}


def test_prompt_is_instructions_then_previous_turn_then_input(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine: ScriptedEngine) -> None:
        first = (await client.post("/v1/responses", json={
            "model": MODEL, "input": "Hi there", "instructions": "Be terse."})).json()
        assert first["status"] == "completed" and first["instructions"] == "Be terse."
        second = (await client.post("/v1/responses", json={
            "input": "And again?", "previous_response_id": first["id"],
            "instructions": "Be terse."})).json()
        assert second["previous_response_id"] == first["id"]
        p1, p2 = list(engine.prompts.values())[:2]
        system = {"role": "system", "content": "Be terse."}
        turn = [system, {"role": "user", "content": "Hi there"}]
        assert p1 == tok.encode_chat(turn, add_generation_prompt=True)
        assert p2 == tok.encode_chat([*turn, {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "And again?"}],
                                     add_generation_prompt=True)
        assert p2[:len(p1)] == p1  # the same prefix: the prefix cache serves it
        both = await client.post("/v1/responses", json={
            "instructions": "Be terse.", "input": [{"role": "developer", "content": "Be kind."},
                                                   {"role": "user", "content": "Hi"}]})
        assert both.status_code == 200, both.text  # one system message, as templates want
        assert list(engine.prompts.values())[-1] == tok.encode_chat([
            {"role": "system", "content": "Be terse.\n\nBe kind."},
            {"role": "user", "content": "Hi"}], add_generation_prompt=True)
        u = second["usage"]
        assert u["input_tokens"] == len(p2) and u["output_tokens"] == len("Hello.")
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    run_app(tok, body, script="Hello.")


# ---- the store ------------------------------------------------------------------------------


def _entry(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, (), ({"id": f"msg_{n}"},), ())


def test_store_evicts_the_oldest_past_its_size_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10.0, clock=lambda: now[0])
    for n in range(3):
        store.put(f"resp_{n}", _entry(n))
        now[0] += 1.0
    assert store.get("resp_0") is None and len(store) == 2  # the oldest went first
    assert store.get("resp_1").response == {"id": "resp_1"}
    now[0] = 11.5  # resp_1 (stored at 1.0) is past its age, resp_2 (2.0) is not
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    assert store.delete("resp_2") and not store.delete("resp_2") and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
    with pytest.raises(KvlabError, match="--responses-max-age"):
        ServerLimits(responses_max_age_s=0)


def test_retrieve_delete_input_items_and_store_false(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        made = (await client.post("/v1/responses", json={
            "input": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
            "metadata": {"k": "v"}, "tools": []})).json()
        assert made["metadata"] == {"k": "v"} and made["tools"] == []
        assert made["completed_at"] >= made["created_at"]
        got = await client.get(f"/v1/responses/{made['id']}")
        assert got.status_code == 200 and got.json() == made
        page = (await client.get(f"/v1/responses/{made['id']}/input_items",
                                 params={"order": "asc", "limit": 1})).json()
        assert [i["content"][0]["text"] for i in page["data"]] == ["one"] and page["has_more"]
        rest = (await client.get(f"/v1/responses/{made['id']}/input_items",
                                 params={"order": "asc", "after": page["last_id"]})).json()
        assert [i["content"][0]["text"] for i in rest["data"]] == ["two"]
        error_of(await client.get(f"/v1/responses/{made['id']}", params={"stream": "true"}),
                 400)
        gone = await client.delete(f"/v1/responses/{made['id']}")
        assert gone.json() == {"id": made["id"], "object": "response.deleted", "deleted": True}
        for r in (await client.get(f"/v1/responses/{made['id']}"),
                  await client.delete(f"/v1/responses/{made['id']}")):
            assert error_of(r, 404)["param"] is None
        unkept = (await client.post("/v1/responses", json={"input": "x", "store": False}))
        assert unkept.json()["store"] is False
        error_of(await client.get(f"/v1/responses/{unkept.json()['id']}"), 404)
        assert len(app.state.responses) == 0
    run_app(tok, body, script="ok")


# ---- answers and events ---------------------------------------------------------------------


def test_stream_events_in_order_and_equal_to_the_whole_answer(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        whole = (await client.post("/v1/responses", json={"input": "Hi"})).json()
        r = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = events_of(r.text)
        kinds = [e["type"] for e in events]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * len("Hello there"),
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
        final = events[-1]["response"]
        item = final["output"][0]
        assert "".join(e["delta"] for e in events if "delta" in e) == "Hello there"
        assert events[-2]["item"] == item and item["status"] == "completed"
        assert {e.get("item_id", item["id"]) for e in events[3:-1]} == {item["id"]}
        assert events[0]["response"]["status"] == "in_progress"
        assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
        for answer in (whole, final):
            assert answer["id"].startswith("resp_") and answer["status"] == "completed"
            assert answer["output"][0]["content"] == [
                {"type": "output_text", "text": "Hello there", "annotations": []}]
            assert answer["output"][0]["id"].startswith("msg_")
            assert "output_text" not in answer
    run_app(tok, body, script="Hello there")


def test_max_output_tokens_makes_it_incomplete(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        r = (await client.post("/v1/responses", json={"input": "Hi",
                                                       "max_output_tokens": 4})).json()
        assert r["status"] == "incomplete" and r["completed_at"] is None
        assert r["incomplete_details"] == {"reason": "max_output_tokens"}
        assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 4
        s = await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4,
                                                      "stream": True})
        assert events_of(s.text)[-1]["type"] == "response.incomplete"
    run_app(tok, body, script="Hello there")


def test_required_tool_call_becomes_a_function_call_item(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        req = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required"}
        r = (await client.post("/v1/responses", json=req)).json()
        (call,) = r["output"]
        assert call["type"] == "function_call" and call["id"].startswith("fc_")
        assert call["call_id"].startswith("call_") and call["status"] == "completed"
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather",
                                                                 {"city": "Paris"})
        assert r["tools"] == [WEATHER] and r["tool_choice"] == "required"
        events = events_of((await client.post("/v1/responses",
                                              json={**req, "stream": True})).text)
        kinds = [e["type"] for e in events[2:]]
        deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
        assert kinds == ["response.output_item.added",
                         *["response.function_call_arguments.delta"] * len(deltas),
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
        # the arguments stream as the model writes them
        assert events[2]["item"]["arguments"] == "" and len(deltas) > 2
        assert "".join(deltas) == call["arguments"]
        # the call's result, sent back after it, renders as a tool turn
        back = await client.post("/v1/responses", json={
            "previous_response_id": r["id"], "tools": [WEATHER],
            "input": [{"type": "function_call_output", "call_id": call["call_id"],
                       "output": "sunny"}]})
        assert back.status_code == 200
        assert "Result of get_weather: sunny" in tok.decode(list(engine.prompts.values())[-1])
    run_app(tok, body, script=CALL_TEXT)


def test_reasoning_comes_back_as_a_reasoning_item() -> None:
    reply = Reply(None, ReasoningFormat(), inside_reasoning=False)
    events = []
    for piece in ("<thi", "nk>\nLet me ", "think.</th", "ink>\n\nThe ans", "wer."):
        events += reply.feed(piece)
    events += reply.finish(incomplete=False)
    reasoning, message = reply.items
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert message["content"][0]["text"] == "The answer."
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Let me think."
    assert [e["output_index"] for e in events if e["type"].endswith("item.done")] == [0, 1]


class ThinkingTokenizer(FakeTokenizer):
    """A character tokenizer whose template thinks: `<think>` opens the reply unless
    enable_thinking is false."""

    chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                     "{% if enable_thinking %}<think>{% endif %}</think>")

    def __init__(self) -> None:
        self.variables: list[dict] = []

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: object) -> list[int]:
        self.variables.append(variables)
        opens = variables.get("enable_thinking", True)
        return self.encode(self.apply_chat_template(messages) + ("<think>\n" if opens else ""))


def test_a_thinking_models_reasoning_is_an_item_and_effort_switches_it() -> None:
    tok = ThinkingTokenizer()

    async def body(client: httpx.AsyncClient, app, engine) -> None:
        r = (await client.post("/v1/responses", json={
            "input": "2+2?", "reasoning": {"effort": "high"}})).json()
        reasoning, message = r["output"]
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
        assert message["content"][0]["text"] == "It is 4."
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Let me see.")
        assert r["reasoning"] == {"effort": "high", "summary": None}
        events = events_of((await client.post("/v1/responses", json={
            "input": "2+2?", "stream": True})).text)
        kinds = [e["type"] for e in events]
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta")
        off = (await client.post("/v1/responses", json={
            "input": "2+2?", "reasoning": {"effort": "none"}})).json()
        assert [i["type"] for i in off["output"]] == ["message"]  # the prompt opens no block
        assert tok.variables == [{"enable_thinking": True}, {}, {"enable_thinking": False}]
    run_app(tok, body, script="Let me see.</think>\n\nIt is 4.")


def test_json_schema_format_constrains_the_reply(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"]}
        fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
        r = await client.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})
        assert r.status_code == 200 and r.json()["text"] == {"format": fmt}
        assert json.loads(r.json()["output"][0]["content"][0]["text"]) == {"a": 1}
        (params,) = engine.params.values()
        assert params.structured.kind == "json_schema"
        assert json.loads(params.structured.value) == schema
        bad = await client.post("/v1/responses", json={"input": "x", "text": {"format": {
            "type": "json_schema", "name": "thing", "schema": {"type": "nonsense"}}}})
        assert error_of(bad, 400)["param"].startswith("text.format")
    run_app(tok, body, script='{"a": 1}')


def test_engine_failure_mid_stream_is_a_failed_event(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        engine.fail_next_step = True
        r = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
        events = events_of(r.text)
        assert events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert len(app.state.responses) == 0  # a failed response is not kept
    run_app(tok, body, script="Hello")


def test_truncation_auto_drops_the_oldest_turns_to_fit(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine: ScriptedEngine) -> None:
        previous = None
        for word in ("alpha", "beta"):
            r = await client.post("/v1/responses", json={
                "input": f"{word} " * 30, "previous_response_id": previous})
            previous = r.json()["id"]
        third = {"input": "gamma " * 30, "previous_response_id": previous,
                 "max_output_tokens": 8}
        err = error_of(await client.post("/v1/responses", json=third), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        cut = (await client.post("/v1/responses", json={**third, "truncation": "auto"})).json()
        assert cut["status"] == "completed" and cut["truncation"] == "auto"
        prompt = tok.decode(list(engine.prompts.values())[-1])
        assert "alpha" not in prompt and "beta" in prompt and "gamma" in prompt
        assert cut["usage"]["input_tokens"] + 8 <= 115
        # the kept conversation is what a continuation builds on
        more = (await client.post("/v1/responses", json={
            "input": "delta", "previous_response_id": cut["id"], "truncation": "auto"}))
        assert "alpha" not in tok.decode(list(engine.prompts.values())[-1])
        assert more.status_code == 200
        long = {"input": "omega " * 200, "truncation": "auto"}
        assert error_of(await client.post("/v1/responses", json=long), 400)["code"] == \
            "context_length_exceeded"
    run_app(tok, body, script="ok", max_model_len=115)


# ---- bad input --------------------------------------------------------------------------------


BAD = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": [{"type": "computer_call"}]}, "input.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input.0.arguments"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{**WEATHER, "extra": 1}]}, "tools.0.extra"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
     "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "tools": [{**WEATHER, "strict": True}],
      "text": {"format": {"type": "json_object"}}}, "tools"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "temperature": 1e308}, "temperature"),
    ({"input": "x", "max_output_tokens": 10 ** 9}, "max_output_tokens"),
]


def test_bad_bodies_are_400s_naming_the_field(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        for req, param in BAD:
            err = error_of(await client.post("/v1/responses", json=req), 400)
            assert err["param"] == param, (req, err)
        web = error_of(await client.post("/v1/responses", json=BAD[10][0]), 400)
        assert "web_search" in web["message"] and "function" in web["message"]
        image = error_of(await client.post("/v1/responses", json=BAD[6][0]), 400)
        assert "text only" in image["message"]
        unknown = await client.post("/v1/responses", json={
            "input": "x", "previous_response_id": "resp_nope"})
        err = error_of(unknown, 404)
        assert err["param"] == "previous_response_id" and "resp_nope" in err["message"]
        other = await client.post("/v1/responses", json={"model": "gpt-5", "input": "x"})
        assert error_of(other, 404)["code"] == "model_not_found"
        assert not engine.prompts  # nothing reached the engine
    run_app(tok, body)


def test_oversize_body_is_413(tok) -> None:
    async def body(client: httpx.AsyncClient, app, engine) -> None:
        r = await client.post("/v1/responses", json={"input": "x" * 4096})
        assert error_of(r, 413)
    run_app(tok, body, limits=ServerLimits(max_request_bytes=2048))


# ---- end to end: kvlab serve and the official client -------------------------------------------


class Pick(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    color: typing.Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[typing.Any]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log, "--max-num-seqs", "4") as server:
        yield server.client()


@pytest.mark.slow
def test_e2e_plain_and_streamed(client) -> None:
    r = client.responses.create(model=MODEL, input="Name three colors.", temperature=0,
                                max_output_tokens=12)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    stream = client.responses.create(model=MODEL, input="Name three colors.", temperature=0,
                                     max_output_tokens=12, stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type.startswith("response.")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == r.output_text  # greedy: the same
    with client.responses.stream(model=MODEL, input="Pick a name and a color.",
                                 text_format=Pick, temperature=0,
                                 max_output_tokens=100) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert isinstance(final.output_parsed, Pick)


@pytest.mark.slow
def test_e2e_required_tool_call_then_its_result(client) -> None:
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=[WEATHER], tool_choice="required", temperature=0,
                                max_output_tokens=60)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    back = client.responses.create(model=MODEL, previous_response_id=r.id, temperature=0,
                                   max_output_tokens=20, input=[{
                                       "type": "function_call_output",
                                       "call_id": call.call_id, "output": "Sunny, 22 C"}])
    assert back.output_text and back.previous_response_id == r.id


@pytest.mark.slow
def test_e2e_json_schema_format(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    r = client.responses.create(model=MODEL, input="Describe a person.", temperature=0,
                                max_output_tokens=80, text={"format": {
                                    "type": "json_schema", "name": "person",
                                    "schema": schema, "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120


@pytest.mark.slow
def test_e2e_continued_conversation_hits_the_prefix_cache(client) -> None:
    rules = "You answer questions about geography in one short sentence. " * 6
    first = client.responses.create(model=MODEL, instructions=rules, temperature=0,
                                    input="What is the capital of France?",
                                    max_output_tokens=8)
    second = client.responses.create(model=MODEL, instructions=rules, temperature=0,
                                     previous_response_id=first.id, input="And of Spain?",
                                     max_output_tokens=8)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id).data
    assert [i.content[0].text for i in items] == ["And of Spain?"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"
