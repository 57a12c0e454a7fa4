"""Each reasoning format of `kvlab.server.core.reasoning.FORMATS`: found from the chat templates
that speak it (llama.cpp's template folder, where KVLAB_LLAMA_VOCABS names it), replies written
as each template teaches split the same whole and streamed at every cut, each thinking switch
with its template's values, harmony's special-token markers kept in the decoded text, and a
gpt-oss chat completion on the fake engine giving `reasoning_content` beside the content or a
commentary-channel tool call."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvlab.server.core.errors import ApiError
from kvlab.server.core.reasoning import (
    HARMONY,
    ReasoningFormat,
    ReasoningStream,
    reasoning_format,
    split_reasoning,
)
from kvlab.tokenizer.chat import render_chat_template

from fake_engine import FakeEngine, FakeTokenizer, run_on_app

THINK = ReasoningFormat()
GRANITE = ReasoningFormat(dropped=("<response>", "</response>"), switch="thinking")
SEED = ReasoningFormat("<seed:think>", "</seed:think>", "thinking_budget", (-1, 0))
MINIMAX_M3 = ReasoningFormat("<mm:think>", "</mm:think>", "thinking_mode", ("enabled", "disabled"))

GEMMA4 = ReasoningFormat("<|channel>thought", "<channel|>", "enable_thinking",
                         tokens=("<|channel>", "<channel|>"))
COHERE = ReasoningFormat("<|START_THINKING|>", "<|END_THINKING|>", "reasoning",
                         dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>"))

# template file -> its format; every other template in the folder has none
EXPECTED = {
    "google-gemma-4-31B-it.jinja": GEMMA4,
    "google-gemma-4-31B-it-interleaved.jinja": GEMMA4,
    "Cohere2MoE.jinja": COHERE,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": replace(COHERE,
                                                                   switch="enable_thinking"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": GRANITE,
    "ByteDance-Seed-OSS.jinja": SEED,
    "MiniMax-M3.jinja": MINIMAX_M3,
    "openai-gpt-oss-120b.jinja": HARMONY,
    **{name: THINK for name in (
        "Kimi-K2-Thinking.jinja", "LFM2.5-8B-A1B.jinja",
        "LFM2.5-Instruct.jinja", "MiniMax-M2.jinja", "NVIDIA-Nemotron-Nano-v2.jinja",
        "StepFun3.5-Flash.jinja", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        "llama-cpp-deepseek-r1.jinja")},
    **{name: ReasoningFormat(switch="enable_thinking") for name in (
        "Bielik-11B-v3.0-Instruct.jinja", "GLM-4.6.jinja", "GLM-4.7-Flash.jinja",
        "HuggingFaceTB-SmolLM3-3B.jinja",
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "Qwen-QwQ-32B.jinja",
        "Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", "Reka-Edge.jinja", "Spark2.5.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
        "deepseek-ai-DeepSeek-V4.jinja", "inclusionai-ling-3.0-flash.jinja",
        "llama-cpp-rwkv-world.jinja", "openbmb-MiniCPM5-1B.jinja",
        "poolside-Laguna-S-2.1.jinja", "poolside-Laguna-XS-2.1.jinja",
        "poolside-Laguna-XS.2.jinja")},
}


def _templates() -> list[Path]:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    found = (Path(folder) / "templates") if folder else None
    return sorted(found.glob("*.jinja")) if found and found.is_dir() else []


@pytest.mark.skipif(not _templates(), reason="set KVLAB_LLAMA_VOCABS to llama.cpp's models/ "
                                             "folder (its templates/ holds the chat templates)")
def test_every_template_in_the_folder_gets_its_format() -> None:
    found = {p.name: reasoning_format(p.read_text()) for p in _templates()}
    assert {n: f for n, f in found.items() if f is not None} == EXPECTED


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user asks for 6*7. Six sevens are 42.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>It is 42.")
GRANITE_REPLY = ("<think>The user asks for 6*7. Six sevens are 42.</think>"
                 "<response>It is 42.</response>")
@pytest.mark.skipif(not _templates(), reason="set KVLAB_LLAMA_VOCABS to llama.cpp's models/ "
                                             "folder (its templates/ holds the chat templates)")
@pytest.mark.parametrize("name", ["ByteDance-Seed-OSS.jinja", "MiniMax-M3.jinja",
                                  "Qwen-Qwen3-0.6B.jinja", "google-gemma-4-31B-it.jinja",
                                  "Cohere2MoE.jinja",
                                  "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"])
def test_the_switch_off_closes_the_block_in_the_prompt(name) -> None:
    template = (_templates()[0].parent / name).read_text()
    fmt = reasoning_format(template)
    on, off = fmt.switch_values

    def prompt(value: object) -> str:
        return render_chat_template(template, [{"role": "user", "content": "6*7?"}],
                                    bos_token="<s>", eos_token="</s>", **{fmt.switch: value})
    assert fmt.closes(prompt(off)) and not fmt.closes(prompt(on))


def test_thinking_switch_takes_the_formats_values() -> None:
    class MiniMaxTokenizer(FakeTokenizer):
        chat_template = "{{ thinking_mode }}<mm:think></mm:think>"
    found = []

    async def read(client: httpx.AsyncClient, app) -> None:
        serving = app.state.serving
        found.extend([serving.thinking_vars(True, "think"), serving.thinking_vars(False, "think"),
                      serving.effort_vars("none", "reasoning_effort")])
    run_on_app(FakeEngine(tokenizer=MiniMaxTokenizer()), read)
    assert found == [{"thinking_mode": "enabled"}, {"thinking_mode": "disabled"},
                     {"thinking_mode": "disabled"}]


def test_harmony_always_thinks() -> None:
    async def read(client: httpx.AsyncClient, app) -> None:
        with pytest.raises(ApiError, match="always thinks"):
            app.state.serving.thinking_vars(False, "think")
    run_on_app(FakeEngine(tokenizer=HarmonyTokenizer()), read)


CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')

# (format, reply as its template writes an assistant turn, inside, (reasoning, content))
REPLIES = [
    (THINK, "<think>\nThe user asks for 6*7. Six sevens are 42.\n</think>\n\nIt is 42.", False,
     ("The user asks for 6*7. Six sevens are 42.", "It is 42.")),
    (THINK, "Six sevens are 42.\n</think>\n\nIt is 42.", True,  # the prompt opened the block
     ("Six sevens are 42.", "It is 42.")),
    (GRANITE, GRANITE_REPLY, False,
     ("The user asks for 6*7. Six sevens are 42.", "It is 42.")),
    (GRANITE, "It is 42.", False, (None, "It is 42.")),  # thinking off
    (SEED, "<seed:think>The user asks for 6*7. Six sevens are 42.</seed:think>It is 42.", False,
     ("The user asks for 6*7. Six sevens are 42.", "It is 42.")),
    (MINIMAX_M3, "<mm:think>Six sevens are 42.</mm:think>\nIt is 42.", False,
     ("Six sevens are 42.", "It is 42.")),
    (HARMONY, HARMONY_REPLY, False,
     ("The user asks for 6*7. Six sevens are 42.", "It is 42.")),
    (HARMONY, "<|channel|>final<|message|>It is 42.", False, (None, "It is 42.")),
    (HARMONY, "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>" + CALL,
     False, ("Need the weather: call get_weather.", CALL)),
    (GEMMA4, "<|channel>thought\nThe user asks for 6*7. Six sevens are 42.\n<channel|>It is 42.",
     False, ("The user asks for 6*7. Six sevens are 42.", "It is 42.")),
    (COHERE, ("<|START_THINKING|>Six sevens are 42.<|END_THINKING|><|START_RESPONSE|>It is 42."
              "<|END_RESPONSE|>"), False, ("Six sevens are 42.", "It is 42.")),
    (COHERE, "Six sevens are 42.<|END_THINKING|><|START_RESPONSE|>It is 42.<|END_RESPONSE|>",
     True, ("Six sevens are 42.", "It is 42.")),  # Command-A's prompt opens the block
]
IDS = ["think", "think-open", "granite", "granite-off", "seed", "minimax-m3", "harmony",
       "harmony-final-only", "harmony-tool-call", "gemma4", "cohere", "cohere-open"]


@pytest.mark.parametrize("fmt,text,inside,expected", REPLIES, ids=IDS)
def test_whole_reply_split(fmt, text, inside, expected) -> None:
    assert split_reasoning(text, fmt, inside) == expected


@pytest.mark.parametrize("fmt,text,inside,expected", REPLIES, ids=IDS)
def test_stream_split_equals_whole_at_every_cut(fmt, text, inside, expected) -> None:
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], [text[i:i + cut] for i in range(0, len(text), cut)]):
            stream = ReasoningStream(fmt, inside)
            outs = [stream.feed(p) for p in pieces] + [stream.finish()]
            reasoning = "".join(r for r, _ in outs)
            content = "".join(c for _, c in outs)
            assert (reasoning.strip() if stream.seen_start else None,
                    content.lstrip("\n") if stream.seen_start else content) == expected, pieces


def test_a_marker_that_may_no_longer_act_is_text() -> None:
    assert split_reasoning("It is <seed:think>42</seed:think>.", SEED) == (
        None, "It is <seed:think>42</seed:think>.")
    assert split_reasoning("<think>a</think>b<think>c</think>", GRANITE) == (
        "a", "b<think>c</think>")


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
                    "<|end|>{% endfor %}{% if tools %}{{ tools }}{% endif %}"
                    "{# <|channel|>analysis<|message|> ... <|end|>, "
                    "<|channel|>commentary to=functions.f ... <|call|> #}<|start|>assistant")
SPECIALS = {"<|start|>": 300, "<|channel|>": 301, "<|message|>": 302, "<|end|>": 303,
            "<|call|>": 304, "<|constrain|>": 305}


class HarmonyTokenizer(FakeTokenizer):
    """Characters, except harmony's markers, which are one special token each."""

    chat_template = HARMONY_TEMPLATE
    vocab_size = 310

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [SPECIALS[text]] if text in SPECIALS else super().encode(text)

    def is_special(self, token_id: int) -> bool:
        return token_id in SPECIALS.values()


def post_harmony(body: dict, reply: str) -> tuple[httpx.Response, tuple[int, ...]]:
    """A chat completion on the fake engine writing `reply`, and the ids decoding shows."""
    result = []

    async def call(client: httpx.AsyncClient, app) -> None:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "6*7?"}], "max_tokens": 400, **body})
        result.append((r, app.state.serving.shown_special_ids))
    run_on_app(FakeEngine(tokenizer=HarmonyTokenizer(), reply=reply), call)
    return result[0]


def test_harmony_markers_stay_in_the_decoded_text() -> None:
    _, shown = post_harmony({}, HARMONY_REPLY)
    assert {300, 301, 302, 303} <= set(shown)


def test_harmony_chat_completion_gives_reasoning_and_content() -> None:
    r, _ = post_harmony({}, HARMONY_REPLY)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user asks for 6*7. Six sevens are 42."
    assert message["content"] == "It is 42."


def test_harmony_stream_gives_reasoning_and_content() -> None:
    r, _ = post_harmony({"stream": True}, HARMONY_REPLY)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning.strip() == "The user asks for 6*7. Six sevens are 42."
    assert content == "It is 42."


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_REPLY = "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>" + CALL


def test_harmony_commentary_tool_call_beside_reasoning() -> None:
    r, _ = post_harmony({"tools": TOOLS}, TOOL_REPLY + "<|call|>")
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Need the weather: call get_weather."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert not message["content"]


def test_harmony_gate_ends_the_block_with_the_final_channel_header() -> None:
    """A structure (or a budget's forced end) follows the final channel's header, where the
    answer begins, not the bare `<|end|>`."""
    gates = []

    async def read(client: httpx.AsyncClient, app) -> None:
        serving = app.state.serving
        prompt = serving.tokenizer.encode("<|start|>user<|message|>6*7?<|end|><|start|>assistant")
        gates.append(serving.reasoning_gate(prompt, structured=True))
    run_on_app(FakeEngine(tokenizer=HarmonyTokenizer()), read)
    [gate] = gates
    decode = HarmonyTokenizer().decode
    assert not gate.inside and decode(gate.start_ids) == "<|channel|>analysis<|message|>"
    assert decode(gate.end_ids) == "<|end|><|start|>assistant<|channel|>final<|message|>"


def test_harmony_streamed_tool_call_beside_reasoning() -> None:
    r, _ = post_harmony({"tools": TOOLS, "stream": True}, TOOL_REPLY + "<|call|>")
    deltas = [c["choices"][0]["delta"] for c in (json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (
        "Need the weather: call get_weather.")
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}


def test_harmony_reasoning_in_every_api() -> None:
    """Anthropic's thinking block, the Responses reasoning item and Ollama's `thinking` read
    the same split."""
    out = {}
    user = [{"role": "user", "content": "6*7?"}]

    async def call(client: httpx.AsyncClient, app) -> None:
        out["anthropic"] = (await client.post("/v1/messages", json={
            "model": "fake", "max_tokens": 400, "messages": user})).json()["content"]
        out["responses"] = (await client.post("/v1/responses", json={
            "input": "6*7?"})).json()["output"]
        out["ollama"] = (await client.post("/api/chat", json={
            "model": "fake", "stream": False, "messages": user})).json()["message"]
    run_on_app(FakeEngine(tokenizer=HarmonyTokenizer(), reply=HARMONY_REPLY), call)
    why = "The user asks for 6*7. Six sevens are 42."
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in out["anthropic"]] == [
        ("thinking", why), ("text", "It is 42.")]
    reasoning, message = out["responses"]
    assert reasoning["content"][0]["text"] == why
    assert message["content"][0]["text"] == "It is 42."
    assert (out["ollama"]["thinking"], out["ollama"]["content"]) == (why, "It is 42.")
