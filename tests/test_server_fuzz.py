"""Property-based fuzzing of every endpoint on the real default model, with `hypothesis`.

Bodies are generated from three families: any bytes, any JSON value, and request-shaped
objects whose fields take valid values, wrong types, huge and empty values and unicode edge
cases (lone surrogates, NUL, combining marks, special-token text). Whatever comes in, the
answer is never a 5xx, an error is always OpenAI's JSON shape, and afterwards the server is
healthy with nothing left running. `KVLAB_FUZZ_EXAMPLES` sets the examples per endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("KVLAB_FUZZ_EXAMPLES", "120"))
SEEN: Counter = Counter()  # (endpoint, status) -> count, printed at the end


def encodable(text: str) -> bool:
    """A query string carries UTF-8: lone surrogates cannot even be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- strategies --------------------------------------------------------------------------------

EDGE_TEXT = st.sampled_from([
    "", " ", "\x00", "\ud800", "a\udfffb", "e\u0301" * 50, "<start_of_turn>", "<eos>", "<bos>",
    "\u202e\u2066", "😀" * 100, "\n" * 500, "word " * 20_000, "\ufeff", "\\u0000", "%s%n{0}",
])
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=60), EDGE_TEXT)
GOOD_TEXT = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), min_size=1,
                              max_size=60), EDGE_TEXT.filter(lambda t: t and encodable(t)))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-5, 40),
                   st.floats(allow_nan=False), TEXT)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
MAX_TOKENS = st.one_of(st.integers(-3, 6), st.just(1 << 40), JSON)  # never a long generation


VALID = {  # each field's valid values; "weird" bodies also give any JSON in its place
    "model": st.sampled_from(["gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf"]),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 300_000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(1 << 63), (1 << 64) - 1),
    "stop": st.one_of(GOOD_TEXT.filter(bool), st.lists(GOOD_TEXT.filter(bool), max_size=4)),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop_token_ids": st.lists(st.integers(0, 262_143), max_size=4),
    "ignore_eos": st.booleans(),
}
COMPLETION_ONLY = {"logprobs": st.integers(0, 5), "echo": st.booleans(),
                   "structured_outputs": st.sampled_from([
                       {"regex": "[a-z]{1,5}"}, {"choice": ["yes", "no"]},
                       {"grammar": 'root ::= "a" [0-9]'}, {"json_object": True}])}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}
CHAT_ONLY = {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
             "max_completion_tokens": st.integers(1, 6),
             "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
                 "type": "json_schema", "json_schema": {"name": "s", "schema": TOOL[
                     "function"]["parameters"]}}]),
             "tools": st.just([TOOL]), "tool_choice": st.sampled_from(["auto", "none"])}
PROMPT = st.one_of(GOOD_TEXT, GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1, max_size=3),
                   st.lists(st.integers(0, 262_143), min_size=1, max_size=8))
WEIRD_PROMPT = st.one_of(TEXT, st.lists(TEXT, max_size=3),
                         st.lists(st.integers(-5, 300_000), max_size=8),
                         st.lists(st.lists(st.integers(-5, 300_000), max_size=4), max_size=3),
                         JSON)
CONTENT = st.one_of(GOOD_TEXT, st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": GOOD_TEXT}), min_size=1, max_size=3))


def conversation(system: str | None, turns: list) -> list[dict]:
    """An optional system message, then user / assistant turns ending with the user's."""
    roles = ["user", "assistant"] * len(turns)
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": role, "content": c} for role, c in zip(roles, [*turns, *turns][
        :2 * len(turns) - 1])]


WEIRD_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["tool", "robot"]), JSON)},
    optional={"content": JSON, "tool_calls": JSON})
MESSAGES = st.builds(conversation, st.none() | GOOD_TEXT, st.lists(CONTENT, min_size=1,
                                                                  max_size=3))


def weird(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    """The same fields, each valid, or any JSON value (wrong types, empty, huge, nested)."""
    return {k: st.one_of(v, v, JSON) for k, v in fields.items()}


def request(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy],
            extra_weird: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Request bodies: all-valid ones (generation runs) and weird ones, half and half."""
    good = st.fixed_dictionaries({**required, "max_tokens": st.integers(1, 6)}, optional=optional)
    bad_required = {**weird(required), "max_tokens": MAX_TOKENS}
    for key in required:
        bad_required[key] = extra_weird.get(key, bad_required[key])
    bad_optional = {k: v for k, v in {**weird(optional), **extra_weird}.items()
                    if k not in required}
    bad = st.fixed_dictionaries(bad_required, optional=bad_optional)
    return st.one_of(good, bad)


COMPLETION = request({"prompt": PROMPT}, {**VALID, **COMPLETION_ONLY},
                     {"prompt": WEIRD_PROMPT, "suffix": TEXT, "stream_options": JSON})
CHAT = request({"messages": MESSAGES}, {**VALID, **CHAT_ONLY},
               {"messages": st.one_of(st.lists(WEIRD_MESSAGE, min_size=1, max_size=2), JSON),
                "tools": JSON, "tool_choice": JSON, "response_format": JSON})
VIZ_RUN = request({"prompt": GOOD_TEXT},
                  {"users": st.integers(1, 3), "temperature": st.floats(0, 2),
                   "arrival": st.sampled_from(["staggered", "together"])},
                  {"seed": SCALAR, "top_k": SCALAR, "users": st.integers(-2, 40)})


def bodies(shaped: st.SearchStrategy) -> st.SearchStrategy:
    """Raw bytes, any JSON, or a request-shaped object (most often)."""
    as_json = st.one_of(shaped, shaped, shaped, JSON).map(
        lambda v: json.dumps(v, ensure_ascii=True).encode())
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=200))


# ---- the server ----------------------------------------------------------------------------------


class Driver:
    """The app on the real engine, in-process, driven from one event loop."""

    def __init__(self, model_path) -> None:
        from kvlab.engine import Engine, EngineConfig
        from kvlab.server.apis import front_ends
        from kvlab.server.core.app import create_app
        from kvlab.server.core.async_engine import AsyncEngine
        from kvlab.server.core.guard import ServerLimits

        engine = Engine.from_model(str(model_path), EngineConfig(max_model_len=2048))
        self.engine = AsyncEngine(engine, max_waiting=8)
        app = create_app(self.engine, front_ends(),
                         limits=ServerLimits(request_timeout=20))
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://kvlab", timeout=60)

    def send(self, method: str, path: str, content: bytes | None = None,
             params: dict | None = None) -> httpx.Response:
        return self.loop.run_until_complete(self.client.request(
            method, path, content=content, params=params,
            headers={"content-type": "application/json"}))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.engine.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def driver(default_model_path):
    d = Driver(default_model_path)
    yield d
    r = d.send("GET", "/health")
    assert r.status_code == 200 and r.json()["num_requests"] == 0, r.text
    d.close()
    total = sum(SEEN.values())
    fives = sum(n for (_, status), n in SEEN.items() if status >= 500)
    print(f"\nfuzz: {total} generated requests, {fives} answered 5xx; by endpoint and "
          f"status: {dict(sorted(SEEN.items()))}")


def check(path: str, r: httpx.Response) -> None:
    SEEN[(path, r.status_code)] += 1
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert "Traceback" not in err["message"]
    elif r.headers.get("content-type", "").startswith("application/json"):
        r.json()


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(COMPLETION))
def test_completions_fuzz(driver, body: bytes) -> None:
    check("/v1/completions", driver.send("POST", "/v1/completions", body))


@FUZZ
@given(body=bodies(CHAT))
def test_chat_fuzz(driver, body: bytes) -> None:
    check("/v1/chat/completions", driver.send("POST", "/v1/chat/completions", body))


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
@given(body=bodies(VIZ_RUN))
def test_viz_run_fuzz(driver, body: bytes) -> None:
    check("/viz/api/run", driver.send("POST", "/viz/api/run", body))


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
@given(path=st.sampled_from(["/health", "/metrics", "/v1/models", "/viz/api/pool",
                             "/v1/nothing", "/v1/completions"]),
       method=st.sampled_from(["GET", "POST", "DELETE", "PUT"]), body=st.binary(max_size=64))
def test_other_endpoints_fuzz(driver, path: str, method: str, body: bytes) -> None:
    check(path, driver.send(method, path, body))


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
@given(params=st.dictionaries(st.sampled_from(["hardware", "model", "quant", "prompt_tokens",
                                               "prompt", "output_tokens", "concurrency",
                                               "kv_dtype"]),
                        TEXT.filter(lambda t: len(t) < 500 and encodable(t)), max_size=5))
def test_viz_estimate_fuzz(driver, params: dict) -> None:
    check("/viz/api/estimate", driver.send("GET", "/viz/api/estimate", params=params))
