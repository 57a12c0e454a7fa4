"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version, /):
on the app over a fake engine (options as sampling settings, NDJSON framing, load requests,
context, tool calls, errors in Ollama's shape, nothing held afterwards), then end to end
through `kvlab serve` on the default model with the official `ollama` client."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
import torch
from test_server import start_server

from kvlab.cli.serve import listen_address, ollama_address
from kvlab.config import ModelConfig
from kvlab.cost import LayerSpec, MatrixSpec, ModelSpec
from kvlab.engine import EngineSnapshot
from kvlab.errors import KvlabError
from kvlab.request import SamplingParams
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.guard import ServerLimits
from kvlab.server.ollama.protocol import Options, sampling_params

from fake_engine import FakeEngine, FakeTokenizer

ollama = pytest.importorskip("ollama")

MODEL = "fake"
CHAT = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


class RecordingEngine(FakeEngine):
    """The fake engine, also recording each request's settings, with a snapshot to show."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.added: list[tuple[list[int], SamplingParams]] = []

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        super().add_request(request_id, prompt, params)
        self.added.append((prompt, params))

    def prepare_structure(self, structure) -> None:
        pass

    def embed(self, prompts: list[list[int]], normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
        """[len(prompt), 1, 0, ...] per prompt, so tests can tell the inputs apart."""
        vectors = torch.zeros(len(prompts), 64)
        vectors[:, 0] = torch.tensor([float(len(p)) for p in prompts])
        vectors[:, 1] = 1.0
        vectors = vectors[:, :dimensions] if dimensions else vectors
        return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors

    def snapshot(self) -> EngineSnapshot:
        config = ModelConfig("gemma3", 256, 64, 2, 4, 1, 16, 128, 8192, name=MODEL)
        matrix = MatrixSpec("Q4_K", 64, 64, 2304, "attn_q")
        spec = ModelSpec(MODEL, "loaded", 268_098_176, 5000, (LayerSpec(2304, 4096,
                                                                        matrices=(matrix,)),))
        return EngineSnapshot(MODEL, config, spec, 5000, self.max_model_len, "f16", 16, 64,
                              128, 2, 512, True, hidden_size=64)


Body = Callable[[httpx.AsyncClient, RecordingEngine], Awaitable[None]]


def run_app(body: Body, limits: ServerLimits | None = None, **engine_args) -> None:
    """Run `body(client, engine)` on the app; afterwards nothing may be held."""
    async def main() -> None:
        engine = RecordingEngine(model_name=MODEL, **engine_args)
        ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
        app = create_app(ae, front_ends(), limits or ServerLimits())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                await body(client, engine)
            for _ in range(50):  # aborts reach the engine thread between steps
                if not engine.live:
                    break
                await asyncio.sleep(0.01)
            assert ae.num_live == 0 and not engine.live
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))


def lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert r.text.endswith("\n")
    return [json.loads(line) for line in r.text.splitlines()]


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str)
    return body["error"]


# ---- options ---------------------------------------------------------------------------------


def test_options_become_the_engine_settings() -> None:
    options = Options(temperature=0, top_k=5, top_p=0.5, min_p=0.1, seed=7, stop=["\n"],
                      repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25)
    p = sampling_params(options, 9, None, None)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stop) == \
        (9, 0, 5, 0.5, 0.1, 7, ("\n",))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, 0.25)
    default = sampling_params(Options(), 9, None, None)  # Ollama's runner defaults
    assert (default.temperature, default.top_k, default.top_p, default.repetition_penalty) == \
        (0.8, 40, 0.9, 1.0)


def test_num_predict_and_num_ctx_bound_the_reply() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        async def max_tokens(options: dict) -> int:
            r = await client.post("/api/generate", json={
                "model": MODEL, "prompt": "abc", "raw": True, "stream": False,
                "options": {**options, "num_predict": options.get("num_predict", 2)}})
            assert r.status_code == 200, r.text
            return engine.added[-1][1].max_tokens
        assert await max_tokens({"num_predict": 2}) == 2
        assert await max_tokens({"num_predict": 50, "num_ctx": 10}) == 7  # 3 prompt tokens
        # -1 and -2: until the context ends; checked on a short num_ctx so the fake is quick
        assert await max_tokens({"num_predict": -1, "num_ctx": 8}) == 5
        assert await max_tokens({"num_predict": -2, "num_ctx": 8}) == 5
        r = await client.post("/api/generate", json={"model": MODEL, "prompt": "abc",
                                                     "options": {"num_predict": 0}})
        assert "num_predict" in error_of(r, 400)
    run_app(body)


# ---- chat and generate -------------------------------------------------------------------------


def test_chat_streams_ndjson_and_ends_with_the_counts() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        r = await client.post("/api/chat", json={"model": MODEL, "messages": CHAT,
                                                 "options": {"num_predict": 4}})
        objs = lines(r)
        assert [o["done"] for o in objs] == [False] * 4 + [True]
        assert "".join(o["message"]["content"] for o in objs) == "aaaa"
        assert all(o["model"] == MODEL and o["message"]["role"] == "assistant" and
                   o["created_at"].endswith("Z") for o in objs)
        final = objs[-1]
        assert final["done_reason"] == "length"
        assert final["prompt_eval_count"] == 2 and final["eval_count"] == 4
        for key in ("total_duration", "load_duration", "prompt_eval_duration",
                    "eval_duration"):
            assert isinstance(final[key], int) and final[key] >= 0
        assert final["total_duration"] > 0
        whole = (await client.post("/api/chat", json={
            "model": MODEL, "messages": CHAT, "stream": False,
            "options": {"num_predict": 4}})).json()
        assert whole["message"] == {"role": "assistant", "content": "aaaa"}
        assert whole["done"] is True and whole["eval_count"] == 4
    run_app(body)


def test_generate_returns_context_to_continue_from() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        first = (await client.post("/api/generate", json={
            "model": MODEL, "prompt": "ab", "system": "s", "stream": False,
            "options": {"num_predict": 3}})).json()
        prompt = engine.added[-1][0]
        assert prompt == [ord(c) for c in "sab"]  # the fake template joins the messages
        assert first["response"] == "aaa" and first["context"] == prompt + [97] * 3
        objs = lines(await client.post("/api/generate", json={
            "model": MODEL, "prompt": "c", "context": first["context"],
            "options": {"num_predict": 2}}))
        assert engine.added[-1][0] == first["context"] + [ord("c")]
        assert objs[-1]["context"] == first["context"] + [ord("c"), 97, 97]
        assert "".join(o["response"] for o in objs) == "aa"
        raw = (await client.post("/api/generate", json={
            "model": MODEL, "prompt": "ab", "raw": True, "stream": False,
            "options": {"num_predict": 1}})).json()
        assert "context" not in raw and raw["done_reason"] == "length"
        r = await client.post("/api/generate", json={"model": MODEL, "prompt": "x",
                                                     "context": [1, 999]})
        assert "999" in error_of(r, 400)
    run_app(body)


def test_an_empty_request_is_a_load() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        gen = (await client.post("/api/generate", json={"model": MODEL})).json()
        assert gen["done"] is True and gen["done_reason"] == "load" and gen["response"] == ""
        chat = lines(await client.post("/api/chat", json={"model": MODEL, "messages": [],
                                                          "keep_alive": "5m"}))
        assert chat == [{**chat[0], "done": True, "done_reason": "load",
                         "message": {"role": "assistant", "content": ""}}]
        assert engine.added == []
    run_app(body)


def test_format_becomes_a_structure() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}

    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        for fmt, kind, value in (("json", "json_object", ""),
                                 (schema, "json_schema", json.dumps(schema))):
            r = await client.post("/api/chat", json={
                "model": MODEL, "messages": CHAT, "format": fmt, "stream": False,
                "options": {"num_predict": 1}})
            assert r.status_code == 200, r.text
            structured = engine.added[-1][1].structured
            assert (structured.kind, structured.value) == (kind, value)
        r = await client.post("/api/chat", json={"model": MODEL, "messages": CHAT,
                                                 "format": "xml"})
        assert "format" in error_of(r, 400)
    run_app(body)


def test_tool_calls_come_back_in_ollamas_shape() -> None:
    reply = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    call = {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]

    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        whole = (await client.post("/api/chat", json={
            "model": MODEL, "messages": CHAT, "tools": [WEATHER], "stream": False})).json()
        assert whole["message"] == {"role": "assistant", "content": "", "tool_calls": [call]}
        assert whole["done_reason"] == "stop"
        assert engine.added[-1][1].structured.kind == "grammar"  # a call is well-formed
        objs = lines(await client.post("/api/chat", json={
            "model": MODEL, "messages": CHAT, "tools": [WEATHER]}))
        assert objs[-1]["message"]["tool_calls"] == [call]
        assert "".join(o["message"]["content"] for o in objs) == ""
        again = await client.post("/api/chat", json={  # the call and its result, rendered
            "model": MODEL, "messages": history, "tools": [WEATHER], "stream": False})
        assert again.status_code == 200, again.text
        prompt = "".join(map(chr, engine.added[-1][0]))
        assert '"city": "Paris"' in prompt and "Result of get_weather: sunny" in prompt
    run_app(body, reply=reply)


def test_a_call_whose_arguments_are_no_object_stays_text() -> None:
    reply = '[{"name": "get_weather", "arguments": "Paris"}]'

    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        for stream in (False, True):
            r = await client.post("/api/chat", json={
                "model": MODEL, "messages": CHAT, "tools": [WEATHER], "stream": stream})
            objs = lines(r) if stream else [r.json()]
            assert "".join(o["message"]["content"] for o in objs) == reply
            assert not any("tool_calls" in o["message"] for o in objs)
    run_app(body, reply=reply)


def test_logprobs_come_with_each_piece() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        r = await client.post("/api/generate", json={
            "model": MODEL, "prompt": "x", "logprobs": True, "top_logprobs": 3,
            "stream": False, "options": {"num_predict": 1}})
        assert r.status_code == 200 and engine.added[-1][1].logprobs == 3
        r = await client.post("/api/generate", json={"model": MODEL, "prompt": "x",
                                                     "top_logprobs": 2})
        assert "logprobs" in error_of(r, 400)
    run_app(body)


class ThinkingTokenizer(FakeTokenizer):
    """A template that writes reasoning and has a switch for it (as Qwen3's)."""

    chat_template = "{% if enable_thinking %}think{% endif %}{{ messages }}</think>"


def test_thinking_comes_apart_from_the_answer() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        whole = (await client.post("/api/chat", json={
            "model": MODEL, "messages": CHAT, "think": True, "stream": False})).json()
        assert whole["message"] == {"role": "assistant", "content": "Hi", "thinking": "hmm"}
        objs = lines(await client.post("/api/generate", json={
            "model": MODEL, "prompt": "x", "think": True}))
        assert "".join(o.get("thinking", "") for o in objs) == "hmm"
        assert "".join(o["response"] for o in objs) == "Hi"
        show = (await client.post("/api/show", json={"model": MODEL})).json()
        assert show["capabilities"] == ["completion", "tools", "thinking", "embedding"]
    run_app(body, reply="<think>hmm</think>Hi", tokenizer=ThinkingTokenizer())


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "extra", "names"), [
    ("/api/chat", {"options": {"mirostat": 1}}, ["mirostat", "num_ctx", "repeat_penalty"]),
    ("/api/chat", {"options": {"num_ctx": 99999}}, ["num_ctx", "4096"]),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     ["images"]),
    ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, ["role"]),
    ("/api/chat", {"think": True}, ["thinking"]),
    ("/api/chat", {"think": "high"}, ["think"]),
    ("/api/chat", {"options": {"temperature": "hot"}}, ["temperature"]),
    ("/api/chat", {"options": {"top_p": 2.0}}, ["top_p"]),
    ("/api/chat", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, ["tools"]),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, ["template"]),
    ("/api/generate", {"prompt": "x", "suffix": "y"}, ["suffix"]),
    ("/api/generate", {"prompt": "x", "images": ["aGk="]}, ["images"]),
    ("/api/generate", {"prompt": "x", "raw": True, "system": "s"}, ["raw"]),
    ("/api/generate", {"prompt": "x", "unknown": 1}, ["unknown", "prompt"]),
])
def test_bad_requests_are_ollama_shaped_400s(route: str, extra: dict,
                                             names: list[str]) -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        r = await client.post(route, json={"model": MODEL, "messages": CHAT, **extra}
                              if route == "/api/chat" else {"model": MODEL, **extra})
        message = error_of(r, 400)
        assert all(name in message for name in names), message
        assert engine.added == []
    run_app(body)


def test_model_names_and_other_errors() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        r = await client.post("/api/chat", json={"model": "llama3", "messages": CHAT})
        assert error_of(r, 404) == "model 'llama3' not found"
        ok = await client.post("/api/generate", json={
            "model": f"{MODEL}:latest", "prompt": "x", "stream": False,
            "options": {"num_predict": 1}})
        assert ok.status_code == 200 and ok.json()["model"] == f"{MODEL}:latest"
        error_of(await client.post("/api/chat", content=b"{not json"), 400)
        assert "model" in error_of(await client.post("/api/chat", json={"messages": CHAT}), 400)
        assert error_of(await client.post("/api/show", json={"model": "x"}), 404)
        r = await client.post("/api/show", json={"model": MODEL, "verbose": True})
        assert "verbose" in error_of(r, 400)
        assert "kvlab serves" in error_of(await client.post("/api/pull", json={"model": "x"}), 501)
        error_of(await client.get("/api/nothing"), 404)
    run_app(body)


def test_the_api_key_guards_api_routes_in_ollamas_shape() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        assert error_of(await client.get("/api/tags"), 401)
        r = await client.get("/api/tags", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        assert (await client.get("/")).text == "Ollama is running"  # the probe stays open
    run_app(body, ServerLimits(api_key="k"))


def test_a_failure_mid_stream_ends_with_an_error_line() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        engine.fail_next_step = True
        r = await client.post("/api/generate", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200
        assert "engine step failed" in json.loads(r.text.splitlines()[-1])["error"]
    run_app(body)


def test_a_client_that_leaves_mid_stream_frees_its_request() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        async with client.stream("POST", "/api/generate", json={
                "model": MODEL, "prompt": "x", "options": {"num_predict": 3000}}) as r:
            async for line in r.aiter_lines():
                assert json.loads(line)["done"] is False
                break
    run_app(body)


# ---- embeddings -------------------------------------------------------------------------------


def test_embed_and_the_legacy_embeddings() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        one = (await client.post("/api/embed", json={"model": MODEL, "input": "hello"})).json()
        (vector,) = one["embeddings"]
        assert len(vector) == 64 and abs(sum(v * v for v in vector) - 1) < 1e-6
        assert one["model"] == MODEL and one["prompt_eval_count"] == 5
        assert one["total_duration"] > 0 and one["load_duration"] == 0
        two = (await client.post("/api/embed", json={
            "model": MODEL, "input": ["ab", "abcd"], "dimensions": 8})).json()
        assert [len(v) for v in two["embeddings"]] == [8, 8]
        assert two["embeddings"][0] != two["embeddings"][1]
        empty = (await client.post("/api/embed", json={"model": MODEL, "input": []})).json()
        assert empty == {"model": MODEL, "embeddings": []}
        legacy = (await client.post("/api/embeddings", json={"model": MODEL,
                                                             "prompt": "abc"})).json()
        assert legacy["embedding"][:3] == [3.0, 1.0, 0.0]  # not normalized, as Ollama's
        r = await client.post("/api/embed", json={"model": MODEL, "input": "x",
                                                  "options": {"temperature": 0}})
        assert "temperature" in error_of(r, 400)
        r = await client.post("/api/embed", json={"model": MODEL, "input": "x",
                                                  "dimensions": 65})
        assert "dimensions" in error_of(r, 400)
        r = await client.post("/api/embed", json={"model": "other", "input": "x"})
        assert error_of(r, 404) == "model 'other' not found"
    run_app(body)


# ---- model routes ----------------------------------------------------------------------------


def test_tags_show_ps_version_and_the_probe() -> None:
    async def body(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
        (model,) = (await client.get("/api/tags")).json()["models"]
        assert model["name"] == model["model"] == f"{MODEL}:latest"
        assert model["size"] == 5000 and len(model["digest"]) == 64
        assert model["details"] == {"parent_model": "", "format": "gguf", "family": "gemma3",
                                    "families": ["gemma3"], "parameter_size": "268.10M",
                                    "quantization_level": "Q4_K"}
        show = (await client.post("/api/show", json={"model": MODEL})).json()
        assert show["capabilities"] == ["completion", "tools", "embedding"]
        info = show["model_info"]
        assert info["general.architecture"] == "gemma3"
        assert info["gemma3.context_length"] == 4096 and info["gemma3.embedding_length"] == 64
        assert "num_ctx" in show["parameters"] and show["details"] == model["details"]
        (running,) = (await client.get("/api/ps")).json()["models"]
        assert running["size_vram"] == 0 and running["context_length"] == 4096
        assert running["digest"] == model["digest"]
        assert (await client.get("/api/version")).json()["version"]
        probe = await client.get("/")
        assert probe.text == "Ollama is running"
        assert (await client.head("/")).status_code == 200
    run_app(body)


# ---- kvlab serve --ollama -------------------------------------------------------------------


def test_ollama_listens_where_its_clients_look(monkeypatch) -> None:
    def address(*, ollama: bool, host: str | None = None, port: int | None = None):
        return listen_address(argparse.Namespace(ollama=ollama, host=host, port=port))
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    assert address(ollama=False) == ("127.0.0.1", 8000)
    assert address(ollama=True) == ("127.0.0.1", 11434)
    assert address(ollama=True, port=9000) == ("127.0.0.1", 9000)
    monkeypatch.setenv("OLLAMA_HOST", "0.0.0.0:11500")
    assert address(ollama=True) == ("0.0.0.0", 11500)
    assert address(ollama=True, host="::1") == ("::1", 11500)
    assert address(ollama=False) == ("127.0.0.1", 8000)  # the variable is Ollama's alone
    assert ollama_address("") == ("127.0.0.1", 11434)
    assert ollama_address("example.com") == ("example.com", 11434)
    assert ollama_address("http://example.com/") == ("example.com", 80)
    assert ollama_address("https://[::1]:5000") == ("::1", 5000)
    assert ollama_address(":7000") == ("127.0.0.1", 7000)
    with pytest.raises(KvlabError, match="OLLAMA_HOST"):
        ollama_address("host:port")


# ---- end to end with the official client -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_server(log, "--ollama", "--max-num-seqs", "4") as s:  # --port given wins
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.list().models[0].model


GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.mark.slow
def test_client_chat_and_generate(client, name) -> None:
    whole = client.chat(model=name, messages=CHAT, options=GREEDY)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason in ("stop", "length") and 1 <= whole.eval_count <= 12
    assert whole.prompt_eval_count > 1 and whole.total_duration > 0
    parts = list(client.chat(model=name, messages=CHAT, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    gen = client.generate(model=name, prompt="The capital of France is", options=GREEDY)
    assert gen.response and gen.context and gen.eval_count >= 1
    more = client.generate(model=name, prompt="And of Italy?", context=gen.context,
                           options=GREEDY)
    assert more.prompt_eval_count > len(gen.context)
    streamed = list(client.generate(model=name, prompt="The capital of France is",
                                    options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == gen.response


@pytest.mark.slow
def test_client_json_format_and_tools(client, name) -> None:
    r = client.chat(model=name, format="json", options={"num_predict": 64, "temperature": 0},
                    messages=[{"role": "user", "content": "A JSON object with a colour."}])
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    tools = client.chat(model=name, tools=[WEATHER], options={"temperature": 0,
                                                             "num_predict": 64},
                        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert tools.done and tools.message.role == "assistant"
    for call in tools.message.tool_calls or []:  # the small model may or may not call
        assert call.function.name == "get_weather"
        assert isinstance(call.function.arguments, dict)
    assert tools.message.tool_calls or tools.message.content


@pytest.mark.slow
def test_client_embed(client, name) -> None:
    r = client.embed(model=name, input=["The sky is blue.", "Grass is green."])
    a, b = r.embeddings
    assert len(a) == len(b) > 0 and a != b and r.prompt_eval_count > 4
    assert abs(sum(v * v for v in a) - 1) < 1e-3
    legacy = client.embeddings(model=name, prompt="The sky is blue.")
    assert len(legacy.embedding) == len(a)


@pytest.mark.slow
def test_a_client_finds_the_server_through_ollama_host(server, name, monkeypatch) -> None:
    monkeypatch.setenv("OLLAMA_HOST", server.url.removeprefix("http://"))
    assert [m.model for m in ollama.Client().list().models] == [name]


@pytest.mark.slow
def test_client_model_routes_and_errors(client, name) -> None:
    assert name.endswith(":latest")
    shown = client.show(name)
    assert "completion" in shown.capabilities and shown.template
    assert shown.details.quantization_level == "Q4_K_M"
    assert shown.modelinfo["general.architecture"]
    (running,) = client.ps().models
    assert running.model == name and running.size > 0
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=CHAT)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name, prompt="x", options={"mirostat": 1})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
