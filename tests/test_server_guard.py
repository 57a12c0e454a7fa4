"""The server's front door and its faults, on the fake engine: API key, body size, JSON depth,
OpenAI's bounds, prompt bytes refused before tokenizing, deadlines, work kept off the event
loop, and an engine thread that dies."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.bodies import MAX_JSON_DEPTH, json_depth
from kvlab.server.core.guard import ServerLimits

from fake_engine import FakeEngine, FakeTokenizer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def with_client(engine: FakeEngine, limits: ServerLimits, body) -> None:
    """Run `body(client, async_engine)` against the app on `engine`."""
    ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
    app = create_app(ae, front_ends(), limits=limits)
    await ae.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await body(client, ae)
    finally:
        await ae.stop()


def is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_body_over_the_limit_is_413_before_parsing() -> None:
    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
        err = is_openai_error(await client.post("/v1/completions", content=big), 413)
        assert err["code"] == "request_too_large" and "2048" in err["message"]

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 500
        is_openai_error(await client.post("/v1/completions", content=chunks()), 413)
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200

    run(with_client(FakeEngine(), ServerLimits(max_request_bytes=2048), body))


def test_api_key_guards_the_api_but_not_health() -> None:
    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        r = await client.get("/v1/models")
        assert is_openai_error(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        is_openai_error(await client.get("/v1/models", headers={"Authorization": "Bearer no"}),
                        401)
        good = {"Authorization": "Bearer sekrit"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                              headers=good)
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200

    run(with_client(FakeEngine(), ServerLimits(api_key="sekrit"), body))

    async def protected(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        is_openai_error(await client.get("/health"), 401)
        is_openai_error(await client.get("/metrics"), 401)
        r = await client.get("/health", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200

    run(with_client(FakeEngine(), ServerLimits(api_key="sekrit", protect_metrics=True),
                    protected))


def test_json_depth_skips_strings() -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{"}]}') == 3
    assert json_depth(b'"\\"[[["') == 0
    assert json_depth(b"[" * 5000) == 5000


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"prompt": "x", "top_p": Infinity}', "Infinity is not a JSON value"),
    (b'{"prompt": "x", "max_tokens": 1, "extra": ' + b"[" * (MAX_JSON_DEPTH + 1)
     + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "levels deep"),
    (b"\xff\xfe", "could not parse"),
])
def test_hostile_json_is_400(raw: bytes, needle: str) -> None:
    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert needle in is_openai_error(await client.post(path, content=raw), 400)["message"]
        assert (await client.get("/health")).status_code == 200

    run(with_client(FakeEngine(), ServerLimits(), body))


@pytest.mark.parametrize("extra, param", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 2000}, "stop"),
    ({"logprobs": 6}, "logprobs"),
    ({"n": 17}, "n"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
])
def test_openai_bounds_are_400(extra: dict, param: str) -> None:
    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
        assert is_openai_error(r, 400)["param"] == param

    run(with_client(FakeEngine(), ServerLimits(), body))


@pytest.mark.parametrize("extra", [{"seed": 1 << 70}, {"top_k": 1 << 40}])
def test_values_the_engine_cannot_hold_are_400(extra: dict) -> None:
    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
        is_openai_error(r, 400)
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 21})
        assert is_openai_error(r, 400)["param"] == "top_logprobs"

    run(with_client(FakeEngine(), ServerLimits(), body))


class CountingTokenizer(FakeTokenizer):
    """Sleeps in encode (as a long prompt does, without the GIL) and counts the calls."""

    calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        CountingTokenizer.calls += 1
        time.sleep(0.5)
        return super().encode(text, add_special_tokens)


def test_prompt_too_long_in_bytes_is_refused_before_tokenizing() -> None:
    engine = FakeEngine(max_model_len=64, tokenizer=CountingTokenizer())
    CountingTokenizer.calls = 0

    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        # 64 tokens x 2 bytes (the longest token) x 4 (normalizer slack) = 512 bytes
        r = await client.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 1})
        assert is_openai_error(r, 400)["code"] == "context_length_exceeded"
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "é" * 300}], "max_tokens": 1})
        assert is_openai_error(r, 400)["param"] == "messages"
        assert CountingTokenizer.calls == 0
        r = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        assert is_openai_error(r, 400)["code"] == "context_length_exceeded"  # after tokenizing
        assert CountingTokenizer.calls == 1

    run(with_client(engine, ServerLimits(), body))


def test_tokenizing_does_not_block_the_event_loop() -> None:
    engine = FakeEngine(tokenizer=CountingTokenizer())

    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        slow = [asyncio.ensure_future(client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1})) for _ in range(3)]
        await asyncio.sleep(0.05)
        worst = 0.0
        while not all(t.done() for t in slow):
            t0 = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        assert worst < 0.2, worst
        assert all(t.result().status_code == 200 for t in slow)

    run(with_client(engine, ServerLimits(), body))


def test_deadline_ends_choices_where_they_are() -> None:
    engine = FakeEngine()

    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2000})
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "length"
        assert 0 < len(choice["text"]) < 2000
        async with client.stream("POST", "/v1/completions", json={
                "prompt": "hi", "max_tokens": 2000, "stream": True}) as s:
            events = [line async for line in s.aiter_lines() if line.startswith("data: {")]
        assert json.loads(events[-1][6:])["choices"][0]["finish_reason"] == "length"
        await asyncio.sleep(0.05)
        assert ae.num_live == 0 and not engine.live  # aborted in the engine: blocks freed

    run(with_client(engine, ServerLimits(request_timeout=0.3), body))


class DyingEngine(FakeEngine):
    """Its thread dies (stats raises) once `die` is set: a bug outside a step."""

    die: bool = False

    def stats(self):
        if self.die:
            raise RuntimeError("engine bug")
        return super().stats()


def test_a_dead_engine_thread_fails_everyone_at_once() -> None:
    engine = DyingEngine()

    async def body(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        waiting = asyncio.ensure_future(client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3000}))
        streaming = asyncio.ensure_future(client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3000, "stream": True}))
        while ae.num_live < 2:
            await asyncio.sleep(0.005)
        engine.die = True
        assert is_openai_error(await waiting, 503)["type"] == "service_unavailable_error"
        assert "engine thread has stopped" in (await streaming).text
        assert (await client.get("/health")).status_code == 503
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        is_openai_error(r, 503)

    run(with_client(engine, ServerLimits(), body))
