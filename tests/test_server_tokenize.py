"""/tokenize and /detokenize in vLLM's and llama.cpp's shapes: on the app with the default
model's real tokenizer (ids, round trips, chat prompts equal to the chat route's, bad bodies,
the guard), then once through `kvlab serve` on the default model."""

from __future__ import annotations

import json

import httpx
import pytest
from test_tokenizer_gemma import default_tokenizer

from kvlab.server.core.guard import ServerLimits
from kvlab.server.openai.chat import Call

from fake_engine import FakeEngine, run_on_app

MODEL = "gemma-3-270m-q4_k_m.gguf"
TEXTS = ["Hello world", " leading space", "日本語 😀 café", "a\n\nb\tc", ""]
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def run_app(tok, body, limits: ServerLimits | None = None) -> None:
    """Run `body(client, app)` against the app on a fake engine holding the real tokenizer."""
    run_on_app(FakeEngine(model_name=MODEL, tokenizer=tok), body, limits)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_vllm_prompt_ids_are_the_tokenizers_and_round_trip(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        for text in TEXTS:
            r = (await client.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
            assert r["tokens"] == tok.encode(text) and r["tokens"][0] == tok.bos_id
            assert r == {"count": len(r["tokens"]), "max_model_len": 4096,
                         "tokens": r["tokens"], "token_strs": None}
            bare = (await client.post("/tokenize", json={
                "prompt": text, "add_special_tokens": False, "return_token_strs": True})).json()
            assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
            assert "".join(bare["token_strs"]) == text
            back = await client.post("/detokenize", json={"model": MODEL,
                                                          "tokens": bare["tokens"]})
            assert back.json()["prompt"] == text
            with_bos = await client.post("/detokenize", json={"tokens": r["tokens"]})
            assert with_bos.json()["prompt"] == "<bos>" + text  # specials are written out
    run_app(tok, body)


def test_llama_cpp_content_ids_pieces_and_round_trip(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        for text in TEXTS:
            r = (await client.post("/tokenize", json={"content": text})).json()
            assert r == {"tokens": tok.encode(text, add_special_tokens=False)}
            special = await client.post("/tokenize", json={"content": text, "add_special": True})
            assert special.json()["tokens"] == tok.encode(text)
            pieces = (await client.post("/tokenize", json={"content": text,
                                                           "with_pieces": True})).json()
            assert [p["id"] for p in pieces["tokens"]] == r["tokens"]
            assert "".join(p["piece"] for p in pieces["tokens"]) == text
            back = await client.post("/detokenize", json={"tokens": r["tokens"]})
            assert back.json()["content"] == text
        # a piece that is not whole UTF-8 comes as its bytes, as llama.cpp sends it
        emoji = (await client.post("/tokenize", json={"content": "\U0001f9a9\U0001fae8",
                                                      "with_pieces": True})).json()["tokens"]
        assert all(isinstance(p["piece"], (str, list)) for p in emoji)
        assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                        for p in emoji) == "\U0001f9a9\U0001fae8".encode()
    run_app(tok, body)


def test_messages_are_the_chat_routes_prompt(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        r = (await client.post("/tokenize", json={"model": MODEL, "messages": CHAT})).json()
        chat = Call.chat(app.state.serving, json.dumps({"model": MODEL, "messages": CHAT,
                                                        "max_tokens": 1}).encode())
        assert r["tokens"] == chat.requests[0].prompt_ids == tok.encode_chat(CHAT)
        assert r["count"] == len(r["tokens"]) and r["tokens"].count(tok.bos_id) == 1
        # add_special_tokens: the tokenizer's BOS on top of the template's, as vLLM does
        extra = (await client.post("/tokenize", json={"messages": CHAT,
                                                      "add_special_tokens": True})).json()
        assert extra["tokens"] == [tok.bos_id, *r["tokens"]]
        no_gen = (await client.post("/tokenize", json={
            "messages": CHAT, "add_generation_prompt": False})).json()
        assert no_gen["tokens"] == tok.encode_chat(CHAT, add_generation_prompt=False)
        turn = [*CHAT, {"role": "assistant", "content": "Hello, "}]
        cont = (await client.post("/tokenize", json={
            "messages": turn, "add_generation_prompt": False,
            "continue_final_message": True})).json()
        text = tok.decode(cont["tokens"], skip_special_tokens=False)
        assert text.endswith("<start_of_turn>model\nHello,")  # no end of turn: continued
    run_app(tok, body)


BAD_TOKENIZE = [
    ({"prompt": "a", "content": "b"}, 400, "prompt"),
    ({"prompt": "a", "messages": CHAT}, 400, "messages"),
    ({"model": MODEL}, 400, None),
    ({"prompt": "a", "max_tokens": 3}, 400, "max_tokens"),
    ({"content": "a", "add_special_tokens": True}, 400, "add_special_tokens"),
    ({"messages": CHAT, "with_pieces": True}, 400, "with_pieces"),
    ({"prompt": ["a"]}, 400, "prompt"),
    ({"content": "a", "add_special": "yes"}, 400, "add_special"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0"),
    ({"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ({"prompt": "a", "model": "other.gguf"}, 404, "model"),
    ({"messages": CHAT, "model": "other.gguf"}, 404, "model"),
]


def test_bad_bodies_are_openai_errors(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        for sent, status, param in BAD_TOKENIZE:
            err = error_of(await client.post("/tokenize", json=sent), status)
            assert err["param"] == param, (sent, err)
        err = error_of(await client.post("/tokenize", json={"prompt": "a", "foo": 1}), 400)
        assert "unknown field 'foo'" in err["message"] and "add_special_tokens" in err["message"]
        error_of(await client.post("/tokenize", json=["a"]), 400)
        error_of(await client.post("/tokenize", content=b"{not json"), 400)
        err = error_of(await client.post("/detokenize", json={"tokens": [2, tok.vocab_size]}), 400)
        assert f"[0, {tok.vocab_size - 1}]" in err["message"] and err["param"] == "tokens"
        error_of(await client.post("/detokenize", json={"tokens": [-1]}), 400)
        error_of(await client.post("/detokenize", json={"tokens": "hello"}), 400)
        error_of(await client.post("/detokenize", json={"tokens": [1.5]}), 400)
        error_of(await client.post("/detokenize", json={"tokens": [1], "content": "x"}), 400)
        error_of(await client.post("/detokenize", json={}), 400)
        err = error_of(await client.post("/detokenize", json={"model": "x", "tokens": [1]}), 404)
        assert err["code"] == "model_not_found"
    run_app(tok, body)


def test_guard_covers_both_routes(tok) -> None:
    async def body(client: httpx.AsyncClient, app) -> None:
        good = {"Authorization": "Bearer sekrit"}
        for path, sent in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [2]})):
            err = error_of(await client.post(path, json=sent), 401)
            assert err["code"] == "invalid_api_key"
            assert (await client.post(path, json=sent, headers=good)).status_code == 200
            big = json.dumps({**sent, "prompt": "x" * 5000}).encode()
            err = error_of(await client.post(path, content=big, headers=good), 413)
            assert err["code"] == "request_too_large"
    run_app(tok, body, ServerLimits(api_key="sekrit", max_request_bytes=2048))


@pytest.mark.slow
def test_through_kvlab_serve(tmp_path, tok) -> None:
    from test_server import start_server

    with start_server(tmp_path / "serve.log", "--max-num-seqs", "2") as s:
        r = httpx.post(s.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"})
        assert r.json()["tokens"] == tok.encode("Hello world")
        assert r.json()["max_model_len"] == httpx.get(s.url + "/v1/models").json()[
            "data"][0]["max_model_len"]
        ids = httpx.post(s.url + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert httpx.post(s.url + "/detokenize",
                          json={"tokens": ids}).json()["content"] == "Hello world"
        count = httpx.post(s.url + "/tokenize", json={"messages": CHAT}).json()["count"]
        chat = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == count
