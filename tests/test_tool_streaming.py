"""Tool calls streamed through each API, read by the official clients, on the fake engine.

For a reply written in a family's own call format (the recorded replies of
test_tool_formats), each API streams its calls in its own events while the reply is written:
OpenAI chat as `tool_calls` deltas, Responses as `response.function_call_arguments.delta`
events of a `function_call` item, Anthropic Messages as a `tool_use` block's
`input_json_delta`s. The `openai` and `anthropic` packages put the stream back together, and
per call the fragments concatenate to the arguments the same request gets unstreamed. In
formats whose arguments are JSON text the arguments arrive in several fragments, before the
reply ends.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_tool_formats import CALLS, REPLIES, TOOLS

from kvlab.server.core.tool_formats import FORMATS

from fake_engine import FakeEngine, FakeTokenizer, run_on_app

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")  # the anthropic client's own fork of httpx
openai = pytest.importorskip("openai")

# format -> a word of the template that teaches it (as detect_format reads templates)
TEACHES = {
    "qwen": "<tool_call>", "mistral": "[TOOL_CALLS]", "kimi_k2": "<|tool_calls_section_begin|>",
    "deepseek_v3_1": "tool▁sep", "command_r7b": "<|START_ACTION|>", "minimax_m1":
    '<tool_calls> "arguments"', "gemma4": "<|tool_call>call:",
    "minimax_m2": "<minimax:tool_call>", "lfm2": "<|tool_call_start|>",
}
USER = "Weather in Zürich, and book a trip?"


def tokenizer_for(form: str) -> FakeTokenizer:
    class Teaching(FakeTokenizer):
        chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if tools %}{{ tools | tojson }}{% endif %}"
                         f"{{# calls are written {TEACHES[form]} #}}")
    return Teaching()


class WritingEngine(FakeEngine):
    """Writes its reply whatever structure a request carries (Qwen's and Llama's auto mode
    constrain a call from its first token; the recorded replies already follow it)."""

    def prepare_structure(self, structure: object) -> None:
        pass


def on_app(form: str, body) -> None:
    """Run `body(openai client, anthropic client)` on the fake engine writing the format's
    recorded reply."""
    async def run(client: httpx.AsyncClient, app) -> None:
        assert app.state.serving.tool_form == form
        oa = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
            an = anthropic.AsyncAnthropic(base_url="http://t", api_key="none", http_client=http)
            await body(oa, an)
    run_on_app(WritingEngine(model_name="m.gguf", tokenizer=tokenizer_for(form),
                          reply=REPLIES[form][0]), run)


def grows(form: str) -> bool:
    return FORMATS[form].heads is not None


@pytest.mark.parametrize("form", sorted(TEACHES))
def test_responses_stream_function_call_arguments(form: str) -> None:
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    got: dict[str, object] = {}

    async def body(oa, an) -> None:
        whole = await oa.responses.create(model="m.gguf", input=USER, tools=flat)
        got["whole"] = [(i.call_id, i.name, i.arguments) for i in whole.output
                        if i.type == "function_call"]
        deltas: dict[str, list[str]] = {}
        items = []
        async with oa.responses.stream(model="m.gguf", input=USER, tools=flat) as stream:
            async for ev in stream:
                if ev.type == "response.function_call_arguments.delta":
                    deltas.setdefault(ev.item_id, []).append(ev.delta)
            final = await stream.get_final_response()
        items = [i for i in final.output if i.type == "function_call"]
        got["streamed"] = [(i.name, "".join(deltas[i.id])) for i in items]
        got["final"] = [(i.name, i.arguments) for i in items]
        got["pieces"] = [len(deltas[i.id]) for i in items]
    on_app(form, body)
    whole = [(n, a) for _, n, a in got["whole"]]  # type: ignore[attr-defined]
    assert [(n, json.loads(a)) for n, a in whole] == CALLS
    assert got["streamed"] == got["final"] == whole
    if grows(form):
        assert all(p > 5 for p in got["pieces"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("form", sorted(TEACHES))
def test_anthropic_streams_tool_use_input_json(form: str) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    messages = [{"role": "user", "content": USER}]
    got: dict[str, object] = {}

    async def body(oa, an) -> None:
        whole = await an.messages.create(model="m.gguf", max_tokens=2000, messages=messages,
                                         tools=tools)
        got["whole"] = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
        got["stop"] = whole.stop_reason
        pieces: dict[int, list[str]] = {}
        async with an.messages.stream(model="m.gguf", max_tokens=2000, messages=messages,
                                      tools=tools) as stream:
            async for ev in stream:
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    pieces.setdefault(ev.index, []).append(ev.delta.partial_json)
            final = await stream.get_final_message()
        got["streamed"] = [json.loads("".join(p)) for _, p in sorted(pieces.items())]
        got["final"] = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
        got["final_stop"] = final.stop_reason
        got["pieces"] = [len(p) for p in pieces.values()]
    on_app(form, body)
    assert got["whole"] == got["final"] == CALLS
    assert got["streamed"] == [a for _, a in CALLS]
    assert got["stop"] == got["final_stop"] == "tool_use"
    if grows(form):
        assert all(p > 5 for p in got["pieces"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("form", sorted(TEACHES))
def test_chat_completion_stream_tool_calls(form: str) -> None:
    messages = [{"role": "user", "content": USER}]
    got: dict[str, object] = {}

    async def body(oa, an) -> None:
        whole = await oa.chat.completions.create(model="m.gguf", messages=messages,
                                                 tools=TOOLS)
        got["whole"] = [(c.function.name, c.function.arguments)
                        for c in whole.choices[0].message.tool_calls or []]
        calls: dict[int, list[str]] = {}
        stream = await oa.chat.completions.create(model="m.gguf", messages=messages,
                                                  tools=TOOLS, stream=True)
        async for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if d.function and d.function.name:
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                elif d.function and d.function.arguments:
                    calls[d.index][1] += d.function.arguments
        got["streamed"] = [tuple(c) for _, c in sorted(calls.items())]
    on_app(form, body)
    assert [(n, json.loads(a)) for n, a in got["whole"]] == CALLS  # type: ignore[attr-defined]
    assert got["streamed"] == got["whole"]
