"""Reasoning apart from the answer: the think-marker splitter on whole replies and on deltas
cut anywhere, the thinking switch, and the chat route's `reasoning_content` (whole and
streamed, beside tool calls) on the fake engine with a scripted reply."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.errors import ApiError
from kvlab.server.core.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    reasoning_format,
    split_reasoning,
)

from fake_engine import FakeEngine, FakeTokenizer

THINKING_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                     "{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>{% endif %}")
FMT = ReasoningFormat()
REPLY = "<think>\nSix times seven.\n</think>\n\nIt is 42."


class ThinkingTokenizer(FakeTokenizer):
    chat_template = THINKING_TEMPLATE


@pytest.mark.parametrize("text,inside,expected", [
    (REPLY, False, ("Six times seven.", "It is 42.")),
    ("Six times seven.\n</think>\n\nIt is 42.", True, ("Six times seven.", "It is 42.")),
    ("It is 42.", False, (None, "It is 42.")),
    ("It is <think>42</think>.", False, (None, "It is <think>42</think>.")),
    ("<think>still thinking", False, ("still thinking", "")),
])
def test_split_whole_replies(text, inside, expected) -> None:
    assert split_reasoning(text, FMT, inside) == expected


@pytest.mark.parametrize("cut", range(1, 12))
def test_stream_gives_the_same_split_wherever_the_deltas_are_cut(cut) -> None:
    stream = ReasoningStream(FMT)
    pieces = [REPLY[i:i + cut] for i in range(0, len(REPLY), cut)]
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning = "".join(r for r, _ in outs)
    content = "".join(c for _, c in outs)
    assert reasoning.strip() == "Six times seven." and content.strip() == "It is 42."
    assert "<" not in reasoning + content  # no marker leaks, even cut mid-way


def test_a_marker_that_never_completes_is_text() -> None:
    stream = ReasoningStream(FMT)
    assert stream.feed("<thi") == ("", "")
    assert stream.finish() == ("", "<thi")


def test_format_and_switch_come_from_the_template() -> None:
    assert reasoning_format("{{ messages }}") is None
    assert reasoning_format(THINKING_TEMPLATE) == ReasoningFormat(switch="enable_thinking")
    assert reasoning_format("<think>{{ x }}</think>").switch is None


def run_chat(body: dict, tokenizer=None) -> httpx.Response | list[dict]:
    result = []

    async def main() -> None:
        engine = FakeEngine(tokenizer=tokenizer or ThinkingTokenizer(), reply=REPLY)
        ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
        app = create_app(ae, front_ends())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "6*7?"}], **body})
                result.append(r)
            assert ae.num_live == 0
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))
    return result[0]


def test_chat_answer_carries_reasoning_content() -> None:
    r = run_chat({"max_tokens": 100})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Six times seven."
    assert message["content"] == "It is 42."


def test_chat_stream_sends_reasoning_and_content_deltas() -> None:
    r = run_chat({"max_tokens": 100, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning.strip() == "Six times seven." and content.strip() == "It is 42."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])


def test_a_model_without_think_markers_keeps_it_all_as_content() -> None:
    message = run_chat({"max_tokens": 100}, FakeTokenizer()).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == REPLY


def test_thinking_switch() -> None:
    async def main() -> None:
        plain = AsyncEngine(FakeEngine(), max_waiting=1)  # type: ignore[arg-type]
        thinking = AsyncEngine(FakeEngine(tokenizer=ThinkingTokenizer()),  # type: ignore[arg-type]
                               max_waiting=1)
        plain_app, think_app = create_app(plain, front_ends()), create_app(thinking, front_ends())
        serving = think_app.state.serving
        assert serving.thinking_vars(None, "think") == {}
        assert serving.thinking_vars(False, "think") == {"enable_thinking": False}
        assert plain_app.state.serving.thinking_vars(False, "think") == {}
        with pytest.raises(ApiError, match="does not support thinking"):
            plain_app.state.serving.thinking_vars(True, "think")
    asyncio.run(main())


def test_reasoning_effort_reaches_the_template_or_the_switch() -> None:
    async def main() -> None:
        plain = create_app(AsyncEngine(FakeEngine(), max_waiting=1),  # type: ignore[arg-type]
                           front_ends()).state.serving
        thinking = create_app(AsyncEngine(FakeEngine(tokenizer=ThinkingTokenizer()),  # type: ignore[arg-type]
                                          max_waiting=1), front_ends()).state.serving
        assert thinking.effort_vars("none", "e") == {"enable_thinking": False}
        assert thinking.effort_vars("high", "e") == {"enable_thinking": True}
        assert plain.effort_vars("minimal", "e") == {} and plain.effort_vars(None, "e") == {}
        with pytest.raises(ApiError, match="does not support thinking"):
            plain.effort_vars("high", "e")

        class HarmonyTokenizer(FakeTokenizer):
            chat_template = "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
        harmony = create_app(AsyncEngine(FakeEngine(tokenizer=HarmonyTokenizer()),  # type: ignore[arg-type]
                                         max_waiting=1), front_ends()).state.serving
        assert harmony.effort_vars("low", "e") == {"reasoning_effort": "low"}
    asyncio.run(main())


def test_reasoning_effort_and_the_same_kwarg_is_a_400() -> None:
    r = run_chat({"max_tokens": 5, "reasoning_effort": "none",
                  "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = run_chat({"max_tokens": 100, "reasoning_effort": "high"})
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "Six times seven."
