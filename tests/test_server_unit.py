"""The server's parts without a model: request parsing, Prometheus text, and the AsyncEngine
(commands, fan-out, aborts, the bounded queue) and the app's error mapping on a fake engine."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from kvlab.engine import EngineStats
from kvlab.errors import RequestError
from kvlab.request import FinishReason, RequestOutput, RequestTimings, SamplingParams
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import (
    AsyncEngine,
    EngineOverloaded,
    EngineRequest,
    EngineStepError,
)
from kvlab.server.core.bodies import parse
from kvlab.server.core.errors import ApiError
from kvlab.server.core.prom import ServerMetrics
from kvlab.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)

from fake_engine import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def req(rid: str, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


# ---- the AsyncEngine ---------------------------------------------------------------------------


def test_outputs_fan_out_to_their_generation() -> None:
    async def main() -> dict[str, str]:
        ae = AsyncEngine(FakeEngine())  # type: ignore[arg-type]
        await ae.start()
        gen = await ae.add([req("a", 3), req("b", 5)])
        text: dict[str, str] = {"a": "", "b": ""}
        async for out in gen:
            text[out.request_id] += out.text_delta
        await ae.stop()
        return text

    assert run(main()) == {"a": "aaa", "b": "aaaaa"}


def test_close_aborts_unfinished_requests() -> None:
    async def main() -> FakeEngine:
        fake = FakeEngine()
        ae = AsyncEngine(fake, max_waiting=4)  # type: ignore[arg-type]
        await ae.start()
        gen = await ae.add([req("a", 50)])
        async for _ in gen:
            break
        gen.close()
        await ae.call(lambda engine: None)  # the abort command has run once this returns
        assert ae.num_live == 0
        await ae.stop()
        return fake

    fake = run(main())
    assert fake.aborted == ["a"] and not fake.live


def test_bad_request_and_full_queue_are_refused() -> None:
    async def main() -> None:
        ae = AsyncEngine(FakeEngine(), max_waiting=1)  # type: ignore[arg-type]
        await ae.start()
        with pytest.raises(RequestError):
            await ae.add([req("long", 5000)])
        assert ae.num_live == 0
        gen = await ae.add([req("a", 50), req("b", 50)])
        with pytest.raises(EngineOverloaded):
            await ae.add([req("c"), req("d")])  # capacity 2 running + 1 waiting
        gen.close()
        await ae.stop()

    run(main())


def test_a_failing_step_fails_the_requests_in_flight_only() -> None:
    async def main() -> str:
        fake = FakeEngine()
        ae = AsyncEngine(fake)  # type: ignore[arg-type]
        await ae.start()
        fake.fail_next_step = True
        gen = await ae.add([req("a", 5)])
        with pytest.raises(EngineStepError):
            async for _ in gen:
                pass
        text = "".join([out.text_delta async for out in await ae.add([req("b", 2)])])
        await ae.stop()
        return text

    assert run(main()) == "aa"


def test_stop_ends_streams_with_abort() -> None:
    async def main() -> FinishReason | None:
        ae = AsyncEngine(FakeEngine())  # type: ignore[arg-type]
        await ae.start()
        gen = await ae.add([req("a", 1000)])
        await ae.stop()
        return [out async for out in gen][-1].finish_reason

    assert run(main()) is FinishReason.ABORT


# ---- the app on the fake engine ----------------------------------------------------------------


def test_app_error_shapes_and_queue_full() -> None:
    async def main() -> None:
        ae = AsyncEngine(FakeEngine(), max_waiting=0)  # type: ignore[arg-type]
        app = create_app(ae, front_ends())
        await ae.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aa"
            r = await client.post("/v1/completions", content=b"{nope")
            assert r.status_code == 400 and set(r.json()["error"]) == {
                "message", "type", "param", "code"}
            r = await client.post("/v1/completions", json={"prompt": "hi", "model": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await client.post("/v1/completions", json={"prompt": "hi", "n": 3})
            assert r.status_code == 400 and "at most 2 sequences" in r.text  # can never fit
            busy = asyncio.ensure_future(client.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 200}))
            while not ae.num_live:
                await asyncio.sleep(0.005)
            r = await client.post("/v1/completions", json={"prompt": "hi", "n": 2})
            assert r.status_code == 503, r.text  # could fit, but not now
            assert (await busy).status_code == 200
        await ae.stop()

    run(main())


# ---- protocol and metrics ----------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "stop": [1]}, "stop"),
])
def test_wrong_types_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param


def test_a_field_the_server_does_not_act_on_is_refused_by_name() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, where, listed in (({"cache_prompt": True}, "'cache_prompt'", "temperature"),
                                 ({"stream": True, "stream_options": {"x": 1}},
                                  "'stream_options.x'", "include_usage")):
        with pytest.raises(ApiError) as e:
            parse(ChatCompletionRequest, {**chat, **extra})
        assert e.value.status == 400 and where in e.value.message and listed in e.value.message
    with pytest.raises(ApiError, match="'n_predict' is not supported"):
        parse(CompletionRequest, {"prompt": "hi", "n_predict": 4})


def test_chat_fields_map_to_sampling_params() -> None:
    req = parse(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "temperature": 0, "top_k": 5, "seed": 3, "stop": "x",
        "logprobs": True, "top_logprobs": 2})
    p = sampling_params(req, 7, seed_offset=1)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.logprobs) == (
        7, 0.0, 5, 4, ("x",), 2)
    assert req.messages[0].as_template_dict()["content"] == "hi"
    with pytest.raises(RequestError):
        sampling_params(parse(CompletionRequest, {"prompt": "x", "top_p": 0}), 4)


SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="(\\.|[^"\\])*",?)*\})? '
                    r'(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$')


def test_prometheus_text_is_well_formed() -> None:
    m = ServerMetrics('we"ird.gguf')
    t = RequestTimings(arrival=0.0, scheduled=0.1, first_token=0.3, finished=0.6,
                       token_times=[0.3, 0.4, 0.6], prefill_seconds=0.2)
    m.observe(RequestOutput("a", [], "", True, FinishReason.STOP, 10, 4, 3, timings=t), 0.0,
              "stop")
    text = m.render(EngineStats(1, 2, 100, 25, 16, 64, 40, 10))
    for line in text.splitlines():
        assert line.startswith("# ") or SAMPLE.match(line), line
    assert 'kvlab:kv_cache_usage_perc{model_name="we\\"ird.gguf"} 0.25' in text
    assert 'finished_reason="stop"} 1.0' in text
    assert 'kvlab:time_to_first_token_seconds_bucket{model_name="we\\"ird.gguf",le="0.5"} 1' \
        in text
    assert 'kvlab:inter_token_latency_seconds_count{model_name="we\\"ird.gguf"} 2' in text
    assert 'kvlab:prefix_cache_hit_rate{model_name="we\\"ird.gguf"} 0.25' in text
