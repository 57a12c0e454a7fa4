"""What every API route shares at the front door: browsers (CORS and preflights, only from
--allowed-origins), keys sent as Bearer or x-api-key, model aliases and any-name answering,
and the chat route's assistant prefill and json_object schema: on the app over a fake engine
holding the default model's real tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest
from test_tokenizer_gemma import default_tokenizer

from kvlab.errors import KvlabError
from kvlab.server.core.bodies import parse
from kvlab.server.core.guard import ServerLimits
from kvlab.server.openai.chat import Call
from kvlab.server.openai.protocol import ChatCompletionRequest, structure_of

from fake_engine import FakeEngine, run_on_app

MODEL = "gemma-3-270m-q4_k_m.gguf"
SITE = "http://localhost:3000"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def run_app(tok, body, limits: ServerLimits | None = None) -> None:
    run_on_app(FakeEngine(model_name=MODEL, tokenizer=tok), body, limits)


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 3, **extra}


def test_cors_lets_in_only_the_listed_origins(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": SITE, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == SITE
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = await client.post("/v1/chat/completions", json=chat_body(),
                              headers={"Origin": SITE})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == SITE
        other = await client.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
    run_app(tok, body, ServerLimits(allowed_origins=(SITE,)))


def test_no_origins_no_cors_headers(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        r = await client.post("/v1/chat/completions", json=chat_body(),
                              headers={"Origin": SITE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    run_app(tok, body)


def test_wildcard_origin_needs_a_key() -> None:
    with pytest.raises(KvlabError, match="needs --api-key"):
        ServerLimits(allowed_origins=("*",))
    with pytest.raises(KvlabError, match="origins such as"):
        ServerLimits(allowed_origins=("localhost:3000",))
    assert ServerLimits(allowed_origins=("*",), api_key="k").allowed_origins == ("*",)


def test_wildcard_preflight_passes_without_the_key_but_the_call_needs_it(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": SITE, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        bare = await client.post("/v1/chat/completions", json=chat_body(),
                                 headers={"Origin": SITE})
        assert bare.status_code == 401
        assert bare.headers["access-control-allow-origin"] == "*"  # the page can read why
        keyed = await client.post("/v1/chat/completions", json=chat_body(),
                                  headers={"Origin": SITE, "x-api-key": "k"})
        assert keyed.status_code == 200
    run_app(tok, body, ServerLimits(allowed_origins=("*",), api_key="k"))


def test_key_as_bearer_or_x_api_key(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        for headers, status in (({"Authorization": "Bearer k"}, 200), ({"x-api-key": "k"}, 200),
                                ({"x-api-key": "wrong"}, 401), ({}, 401)):
            r = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert r.status_code == status, (headers, r.text)
        r = await client.post("/v1/chat/completions", json=chat_body())
        assert "x-api-key" in r.json()["error"]["message"]
    run_app(tok, body, ServerLimits(api_key="k"))


def test_aliases_answer_and_are_listed(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["gpt-4o-mini", "local"]
        for name in ("local", MODEL, None):
            r = await client.post("/v1/chat/completions", json=chat_body(model=name))
            assert r.status_code == 200 and r.json()["model"] == "gpt-4o-mini"
        r = await client.post("/v1/chat/completions", json=chat_body(model="claude-x"))
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "--any-model-name" in err["message"]
        assert "local" in err["message"]
    run_app(tok, body, ServerLimits(served_model_names=("gpt-4o-mini", "local")))


def test_any_model_name_answers_under_the_name_asked(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        r = await client.post("/v1/chat/completions", json=chat_body(model="gpt-4.1"))
        assert r.status_code == 200 and r.json()["model"] == "gpt-4.1"
    run_app(tok, body, ServerLimits(any_model_name=True))


def _prompt(app, **body) -> list[int]:
    call = Call.chat(app.state.serving, json.dumps({"model": MODEL, **body}).encode())
    return call.requests[0].prompt_ids


def test_trailing_assistant_message_is_a_prefill(tok) -> None:
    turns = [*CHAT, {"role": "assistant", "content": "My favourite colour is"}]
    continued = tok.encode_chat(turns, add_generation_prompt=False,
                                continue_final_message=True)
    assert tok.decode(continued).endswith("My favourite colour is")

    async def body(client: httpx.AsyncClient, app) -> None:
        assert _prompt(app, messages=turns) == continued
        assert _prompt(app, messages=turns, continue_final_message=True,
                       add_generation_prompt=False) == continued
        closed = _prompt(app, messages=turns, add_generation_prompt=True)
        assert closed == tok.encode_chat(turns, add_generation_prompt=True)
        r = await client.post("/v1/chat/completions", json=chat_body(
            messages=turns, continue_final_message=True, add_generation_prompt=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = await client.post("/v1/chat/completions", json=chat_body(
            continue_final_message=True, add_generation_prompt=False))
        assert r.status_code == 400 and "assistant message" in r.json()["error"]["message"]
    run_app(tok, body)


def test_chat_template_kwargs_reach_the_template_and_own_names_are_refused(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        r = await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"messages": []}))
        assert r.status_code == 400 and "set by the server" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"enable_thinking": False}))
        assert r.status_code == 200
    run_app(tok, body)


def test_json_object_with_a_schema_is_that_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    req = parse(ChatCompletionRequest, chat_body(
        response_format={"type": "json_object", "schema": schema}))
    structure, param = structure_of(req)
    assert structure.kind == "json_schema" and json.loads(structure.value) == schema
    assert param == "response_format"
    plain = parse(ChatCompletionRequest, chat_body(response_format={"type": "json_object"}))
    assert structure_of(plain)[0].kind == "json_object"
