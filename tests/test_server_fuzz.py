"""Property-based fuzzing of every endpoint on the real default model, with `hypothesis`.

Bodies are generated from three families: any bytes, any JSON value, and request-shaped
objects whose fields take valid values, wrong types, huge and empty values and unicode edge
cases (lone surrogates, NUL, combining marks, special-token text). Every API is fuzzed in its
own request shapes: OpenAI's (completions, chat, Responses, embeddings, /tokenize,
/detokenize, /infill), Anthropic's Messages and Ollama's /api/ routes. Whatever comes in, the
answer is never a 5xx, an error is always in the shape of the API whose path was called
(OpenAI's, Anthropic's under /v1/messages, Ollama's under /api/), a stream's every event or
NDJSON line is JSON and none is an error, and afterwards the server is healthy with nothing
left running. Generation stays short (at most 6 tokens a reply). `KVLAB_FUZZ_EXAMPLES` sets
the examples per endpoint (a quarter of it for the lighter ones).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from urllib.parse import quote

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
            extra_weird: dict[str, st.SearchStrategy],
            limit: tuple[str, st.SearchStrategy] | None = ("max_tokens", MAX_TOKENS)
            ) -> st.SearchStrategy:
    """Request bodies: all-valid ones (generation runs) and weird ones, half and half.
    `limit` names the field that bounds the reply (1 to 6 tokens in the valid ones) and its
    weird values."""
    limits = ({limit[0]: st.integers(1, 6)}, {limit[0]: limit[1]}) if limit else ({}, {})
    good = st.fixed_dictionaries({**required, **limits[0]}, optional=optional)
    bad_required = {**weird(required), **limits[1]}
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


def is_long_limit(value) -> bool:
    """A reply bound that would let generation run on: none, or more than 6 tokens."""
    return value is None or (type(value) is int and value > 6)


SHORT_LIMIT = st.one_of(st.integers(-3, 6), JSON.filter(lambda v: not is_long_limit(v)))
COMPLETION_SUFFIX = request({"prompt": PROMPT, "suffix": GOOD_TEXT}, VALID,
                            {"prompt": WEIRD_PROMPT, "suffix": TEXT},
                            ("max_tokens", SHORT_LIMIT))

# ---- OpenAI's Responses, embeddings, /tokenize, /detokenize, /infill ---------------------------

PREVIOUS = "resp_fuzz_previous"  # sent as the id of a response stored earlier in the run
SCHEMA = TOOL["function"]["parameters"]
FLAT_TOOL = {"type": "function", "name": "lookup", "parameters": SCHEMA}
CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q":"a"}'}
RESPONSE_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "system"]),
                           "content": GOOD_TEXT}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries({
                               "type": st.just("input_text"), "text": GOOD_TEXT}),
                               min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": GOOD_TEXT}),
    st.just(CALL),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.sampled_from(["call_1", "call_9"]), "output": GOOD_TEXT}),
    st.just({"type": "reasoning", "summary": []}),
    st.just({"role": "user", "content": [{"type": "input_image",
                                          "image_url": "data:image/png;base64,iVBORw0KGgo="}]}),
)
RESPONSE_INPUT = st.one_of(GOOD_TEXT, GOOD_TEXT, st.builds(
    lambda items, last: [*items, {"role": "user", "content": last}],
    st.lists(RESPONSE_ITEM, max_size=3), GOOD_TEXT))
UNKNOWN_IDS = st.sampled_from(["resp_0_0123456789abcdef", "resp_", "resp_x_y", "msg_1", " "])
RESPONSES = request(
    {"input": RESPONSE_INPUT},
    {"model": VALID["model"], "instructions": GOOD_TEXT, "stream": st.booleans(),
     "store": st.booleans(), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
     "tools": st.just([FLAT_TOOL]), "parallel_tool_calls": st.booleans(),
     "tool_choice": st.sampled_from(["auto", "none", "required",
                                     {"type": "function", "name": "lookup"}]),
     "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                              {"format": {"type": "json_schema", "name": "s",
                                          "schema": SCHEMA}}]),
     "previous_response_id": st.one_of(st.just(PREVIOUS), st.just(PREVIOUS), UNKNOWN_IDS),
     "truncation": st.sampled_from(["auto", "disabled"]),
     "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)},
    {"input": st.one_of(TEXT, st.lists(st.one_of(RESPONSE_ITEM, JSON), max_size=3), JSON),
     "tools": st.one_of(st.lists(st.sampled_from([
         {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []},
         {"type": "mcp", "server_label": "x"}, {"type": "function"}, FLAT_TOOL]), max_size=2),
         JSON),
     "previous_response_id": st.one_of(TEXT, UNKNOWN_IDS, JSON),
     "include": JSON, "tool_choice": JSON, "text": JSON,
     "reasoning": st.sampled_from([{"effort": "low"}, {"effort": "none"}, {"summary": "auto"}])},
    ("max_output_tokens", SHORT_LIMIT))
RESPONSE_ID = st.one_of(st.just(PREVIOUS), UNKNOWN_IDS,
                        TEXT.filter(lambda t: len(t) < 500 and encodable(t)))  # fits a URL

TOKEN_IDS = st.lists(st.integers(-5, 300_000), max_size=8)
EMBEDDINGS = request(
    {"input": st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1, max_size=3),
                        st.lists(st.integers(0, 262_143), min_size=1, max_size=8))},
    {"model": VALID["model"], "encoding_format": st.sampled_from(["float", "base64"]),
     "dimensions": st.integers(1, 640), "user": GOOD_TEXT},
    {"input": st.one_of(WEIRD_PROMPT, st.lists(TOKEN_IDS, max_size=3)),
     "dimensions": st.integers(-2, 100_000)}, None)
TOKENIZE = st.one_of(
    request({"prompt": GOOD_TEXT}, {"model": VALID["model"], "add_special_tokens": st.booleans(),
                                    "return_token_strs": st.booleans()},
            {"prompt": TEXT}, None),
    request({"messages": MESSAGES}, {"add_generation_prompt": st.booleans(),
                                     "continue_final_message": st.booleans(),
                                     "return_token_strs": st.booleans()},
            {"messages": st.one_of(st.lists(WEIRD_MESSAGE, max_size=2), JSON)}, None),
    request({"content": GOOD_TEXT}, {"add_special": st.booleans(), "with_pieces": st.booleans()},
            {"content": TEXT}, None))
DETOKENIZE = request({"tokens": st.lists(st.integers(0, 262_143), max_size=8)},
                     {"model": VALID["model"]}, {"tokens": st.one_of(TOKEN_IDS, JSON)}, None)
INFILL = request({"input_prefix": GOOD_TEXT, "input_suffix": GOOD_TEXT},
                 {"prompt": GOOD_TEXT, "stream": st.booleans(), "temperature": st.floats(0, 2),
                  "input_extra": st.lists(st.fixed_dictionaries(
                      {"filename": GOOD_TEXT, "text": GOOD_TEXT}), max_size=2)},
                 {"input_prefix": TEXT, "input_suffix": TEXT}, ("n_predict", SHORT_LIMIT))

# ---- Anthropic's Messages ----------------------------------------------------------------------

TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": GOOD_TEXT})
IMAGE_BLOCK = st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                   "data": "iVBORw0KGgo="}})
TOOL_USE = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_1"),
                                  "name": st.just("lookup"),
                                  "input": st.fixed_dictionaries({"q": GOOD_TEXT})})
TOOL_RESULT = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["toolu_1", "toolu_9"]),
     "content": st.one_of(GOOD_TEXT, st.lists(TEXT_BLOCK, max_size=2))},
    optional={"is_error": st.booleans()})
THINKING_BLOCK = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": GOOD_TEXT,
                                        "signature": st.just("sig")})
USER_TURN = st.one_of(GOOD_TEXT, GOOD_TEXT, st.lists(
    st.one_of(TEXT_BLOCK, TEXT_BLOCK, TOOL_RESULT, IMAGE_BLOCK), min_size=1, max_size=3))
ASSISTANT_TURN = st.one_of(GOOD_TEXT, st.lists(st.one_of(TEXT_BLOCK, TOOL_USE, THINKING_BLOCK),
                                               min_size=1, max_size=2))
A_MESSAGES = st.builds(  # tool results only after a first assistant turn, which may call
    lambda first, pairs: [{"role": "user", "content": first}, *(m for assistant, user in pairs
                          for m in ({"role": "assistant", "content": assistant},
                                    {"role": "user", "content": user}))],
    st.one_of(GOOD_TEXT, st.lists(TEXT_BLOCK, min_size=1, max_size=2)),
    st.lists(st.tuples(ASSISTANT_TURN, USER_TURN), max_size=2))
A_TOOL = {"name": "lookup", "description": "Look a word up", "input_schema": SCHEMA}
CONVERSATION = {
    "system": st.one_of(GOOD_TEXT, st.lists(TEXT_BLOCK, max_size=2)),
    "tools": st.just([A_TOOL]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "lookup"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                 {"type": "enabled", "budget_tokens": 1024}])}
WEIRD_CONVERSATION = {
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), JSON)},
        optional={"content": st.one_of(USER_TURN, ASSISTANT_TURN, JSON)}), max_size=3), JSON),
    "tools": st.one_of(st.lists(st.sampled_from([
        A_TOOL, {"type": "web_search_20250305", "name": "web_search"},
        {"name": "bad name!", "input_schema": {}}, {"name": "lookup"}]), max_size=2), JSON),
    "tool_choice": JSON, "thinking": JSON}
MESSAGES_BODY = request(
    {"model": VALID["model"], "messages": A_MESSAGES},
    {**CONVERSATION, "stream": st.booleans(), "temperature": st.floats(0, 1),
     "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
     "stop_sequences": st.lists(GOOD_TEXT, max_size=3), "metadata": st.just({"user_id": "u"})},
    WEIRD_CONVERSATION, ("max_tokens", SHORT_LIMIT))
COUNT_TOKENS = request({"model": VALID["model"], "messages": A_MESSAGES}, CONVERSATION,
                       WEIRD_CONVERSATION, None)

# ---- Ollama ----------------------------------------------------------------------------------

O_MODEL = st.sampled_from(["gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m:latest",
                           "gemma-3-270m-q4_k_m.gguf"])
O_OPTIONS = {"temperature": st.floats(0, 2), "top_k": st.integers(0, 100),
             "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
             "seed": st.integers(0, (1 << 31) - 1),
             "stop": st.lists(GOOD_TEXT.filter(bool), max_size=3),
             "repeat_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
             "frequency_penalty": st.floats(-2, 2), "num_ctx": st.integers(256, 2048)}
UNKNOWN_OPTIONS = {k: JSON for k in ("mirostat", "num_gpu", "num_thread", "repeat_last_n")}
# num_predict -1 / -2 would run to the context's end: the weird values keep replies short too
GOOD_OPTIONS = st.fixed_dictionaries({"num_predict": st.integers(1, 6)}, optional=O_OPTIONS)
OPTIONS = st.one_of(
    GOOD_OPTIONS,
    st.fixed_dictionaries({"num_predict": SHORT_LIMIT.filter(lambda v: v not in (-1, -2))},
                          optional={**weird(O_OPTIONS), **UNKNOWN_OPTIONS,
                                    "num_ctx": st.integers(-2, 1 << 20)}),
    JSON.filter(lambda v: v is not None and not isinstance(v, dict)))
FORMAT = st.sampled_from(["json", "", {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}, SCHEMA])
O_TURNS = st.sampled_from([
    [],
    [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "lookup", "arguments": {"q": "a"}}}]},
     {"role": "tool", "content": "42", "tool_name": "lookup"}],
    [{"role": "assistant", "content": "Hm.", "thinking": "Let me see."}]])
IMAGES = st.just(["iVBORw0KGgo="])  # refused: the served model reads text only
O_MESSAGES = st.builds(lambda conv, extra: [*conv[:-1], *extra, conv[-1]],
                       st.builds(conversation, st.none() | GOOD_TEXT,
                                 st.lists(GOOD_TEXT, min_size=1, max_size=3)), O_TURNS)
O_GENERATING = {"stream": st.booleans(), "format": FORMAT, "think": st.booleans(),
                "keep_alive": st.sampled_from([0, "5m", -1]),
                "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
O_WEIRD = {"format": st.one_of(FORMAT, JSON), "think": st.one_of(st.just("high"), JSON),
           "options": OPTIONS}
OLLAMA_CHAT = request({"model": O_MODEL, "messages": O_MESSAGES, "options": GOOD_OPTIONS},
                      {**O_GENERATING, "tools": st.just([TOOL])},
                      {**O_WEIRD, "messages": st.one_of(
                          st.lists(WEIRD_MESSAGE, max_size=2), JSON, st.builds(
                              lambda m, images: [*m[:-1], {**m[-1], "images": images}],
                              O_MESSAGES, IMAGES))}, None)
OLLAMA_GENERATE = request(
    {"model": O_MODEL, "prompt": GOOD_TEXT, "options": GOOD_OPTIONS},
    {**O_GENERATING, "system": GOOD_TEXT, "raw": st.booleans(),
     "context": st.lists(st.integers(0, 262_143), max_size=6)},
    {**O_WEIRD, "prompt": TEXT, "context": st.one_of(TOKEN_IDS, JSON), "images": IMAGES,
     "suffix": GOOD_TEXT, "template": GOOD_TEXT}, None)
OLLAMA_EMBED = request(
    {"model": O_MODEL, "input": st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, max_size=3))},
    {"truncate": st.booleans(), "dimensions": st.integers(1, 640), "keep_alive": st.just("5m")},
    {"input": WEIRD_PROMPT, "dimensions": st.integers(-2, 100_000),
     "options": st.one_of(st.just({"temperature": 0.5}), JSON)}, None)  # refused: no sampling
OLLAMA_EMBEDDINGS = request({"model": O_MODEL, "prompt": GOOD_TEXT},
                            {"keep_alive": st.just("5m")},
                            {"prompt": WEIRD_PROMPT, "options": JSON}, None)
OLLAMA_SHOW = request({"model": st.one_of(O_MODEL, st.just("llama3:8b"))},
                      {"verbose": st.booleans()}, {}, None)




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


def openai_error(body: dict) -> str:
    err = body["error"]
    assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}, body
    return err["message"]


def anthropic_error(body: dict) -> str:
    err = body["error"]
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(err) == {"type", "message"} and isinstance(err["type"], str), body
    return err["message"]


def ollama_error(body: dict) -> str:
    assert set(body) == {"error"}, body
    return body["error"]


ERROR_SHAPES = (("/v1/messages", anthropic_error), ("/api/", ollama_error))


def check_error(path: str, body: dict) -> None:
    """The error body of the API whose path was called, with a message a user can read."""
    shape = next((s for prefix, s in ERROR_SHAPES if path.startswith(prefix)), openai_error)
    message = shape(body)
    assert isinstance(message, str) and message and "Traceback" not in message, body


def stream_items(r: httpx.Response) -> list[dict]:
    """A stream's JSON objects: each NDJSON line, or each server-sent event's data (whose
    type, where the event is named, is its name: Anthropic's and Responses' events)."""
    if r.headers.get("content-type", "").startswith("application/x-ndjson"):
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]
    items = []
    for event in r.text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in event.splitlines() if ":" in line)
        data = fields.get("data", "").strip()
        if data and data != "[DONE]":
            items.append(json.loads(data))
            assert "event" not in fields or fields["event"].strip() == items[-1]["type"], event
    return items


def check_stream(path: str, r: httpx.Response) -> None:
    """Every item of a stream parses; an error item (a failure after the headers went out,
    the 5xx of a stream) is in the API's shape, and fails the check."""
    for item in stream_items(r):
        if item.get("error") is not None or item.get("type") in ("error", "response.failed"):
            if item.get("type") != "response.failed":
                check_error(path, item)
            raise AssertionError(f"the stream of {path} ended in an error: {item}")


def check(path: str, r: httpx.Response) -> None:
    """`path` labels the count; the error shape follows the path actually served."""
    SEEN[(path, r.status_code)] += 1
    assert r.status_code < 500, r.text
    kind = r.headers.get("content-type", "")
    if r.status_code >= 400:
        check_error(r.request.url.path, r.json())
    elif kind.startswith(("text/event-stream", "application/x-ndjson")):
        check_stream(r.request.url.path, r)
    elif kind.startswith("application/json"):
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
                             "/v1/nothing", "/v1/completions", "/v1/responses",
                             "/v1/messages", "/v1/messages/nothing", "/api/tags", "/api/ps",
                             "/api/version", "/api/show", "/api/chat", "/api/nothing", "/",
                             "/tokenize", "/infill"]),
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


# ---- every other API, each in its own shapes -----------------------------------------------------

LIGHT = settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
STORED: list[str] = []  # ids of the responses this run stored, newest last


def with_stored(body: bytes) -> bytes:
    """PREVIOUS stands for the newest stored response (an unknown id before there is one)."""
    return body.replace(PREVIOUS.encode(), (STORED[-1] if STORED else PREVIOUS).encode())


def remember_response(r: httpx.Response) -> None:
    if r.status_code != 200:
        return
    if r.headers.get("content-type", "").startswith("application/json"):
        answers = [r.json()]
    else:
        answers = [e["response"] for e in stream_items(r) if e.get("type") in (
            "response.completed", "response.incomplete")]
    STORED.extend(a["id"] for a in answers if a.get("store"))


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(body=bodies(RESPONSES))
def test_responses_fuzz(driver, body: bytes) -> None:
    r = driver.send("POST", "/v1/responses", with_stored(body))
    check("/v1/responses", r)
    remember_response(r)


@LIGHT
@given(response_id=RESPONSE_ID, method=st.sampled_from(["GET", "DELETE"]),
       input_items=st.booleans(), params=st.dictionaries(
           st.sampled_from(["after", "limit", "order", "include", "stream"]), st.one_of(
               st.integers(-2, 200).map(str), st.sampled_from(["asc", "desc"]),
               TEXT.filter(lambda t: len(t) < 100 and encodable(t))), max_size=2))
def test_stored_responses_fuzz(driver, response_id: str, method: str, input_items: bool,
                               params: dict) -> None:
    """A stored response by id (the newest one, unknown ones, junk): read, list, delete."""
    path = "/v1/responses/" + quote(with_stored(response_id.encode()).decode(), safe="")
    if input_items:
        method, path = "GET", path + "/input_items"
    r = driver.send(method, path, params=params)
    check("/v1/responses/{id}", r)
    if method == "DELETE" and r.status_code == 200:
        STORED.remove(r.json()["id"])


@LIGHT
@given(body=bodies(COMPLETION_SUFFIX))
def test_completions_suffix_fuzz(driver, body: bytes) -> None:
    """A suffix asks for fill-in-the-middle, which the default model has no tokens for."""
    r = driver.send("POST", "/v1/completions", body)
    check("/v1/completions", r)
    assert r.status_code >= 400, r.text


@LIGHT
@given(body=bodies(INFILL))
def test_infill_fuzz(driver, body: bytes) -> None:
    r = driver.send("POST", "/infill", body)
    check("/infill", r)
    assert r.status_code >= 400, r.text  # the default model has no FIM tokens


def posts(*routes: tuple[str, st.SearchStrategy]) -> st.SearchStrategy:
    """(path, body) pairs, each body drawn from its route's request shapes."""
    return st.one_of([st.tuples(st.just(path), bodies(shaped)) for path, shaped in routes])


def post(driver, path_body: tuple[str, bytes]) -> None:
    path, body = path_body
    check(path, driver.send("POST", path, body))


@LIGHT
@given(path_body=posts(("/v1/embeddings", EMBEDDINGS), ("/tokenize", TOKENIZE),
                       ("/detokenize", DETOKENIZE)))
def test_openai_utility_fuzz(driver, path_body: tuple[str, bytes]) -> None:
    post(driver, path_body)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(path_body=posts(("/v1/messages", MESSAGES_BODY), ("/v1/messages", MESSAGES_BODY),
                       ("/v1/messages/count_tokens", COUNT_TOKENS)))
def test_anthropic_fuzz(driver, path_body: tuple[str, bytes]) -> None:
    post(driver, path_body)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(path_body=posts(("/api/chat", OLLAMA_CHAT), ("/api/generate", OLLAMA_GENERATE)))
def test_ollama_generation_fuzz(driver, path_body: tuple[str, bytes]) -> None:
    post(driver, path_body)


@LIGHT
@given(path_body=posts(("/api/embed", OLLAMA_EMBED), ("/api/embeddings", OLLAMA_EMBEDDINGS),
                       ("/api/show", OLLAMA_SHOW)))
def test_ollama_other_fuzz(driver, path_body: tuple[str, bytes]) -> None:
    post(driver, path_body)
