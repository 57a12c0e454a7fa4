"""Tool calls read out of replies in each model family's own format.

Per format, a reply written as its chat template teaches (text before the calls, two parallel
calls, arguments with nested objects and text beyond ASCII) is parsed whole, and fed to
`ToolStream` cut at every position and a character at a time: the text it shows plus the
calls it returns equal the whole reply's parse. Malformed calls stay text. Each real template
in `$KVLAB_LLAMA_VOCABS/templates` is matched to the format it teaches.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from functools import cache
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
from test_tokenizer_gemma import default_tokenizer

from kvlab.errors import RequestError
from kvlab.request import SamplingParams, Structure
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.guard import ServerLimits
from kvlab.server.core.reasoning import reasoning_format, split_reasoning
from kvlab.server.core.serving import special_markers
from kvlab.server.core.tool_formats import FORMATS, detect_format
from kvlab.server.core.tools import ToolPlan, ToolStream, parse_reply, tool_plan
from kvlab.structured.compiler import GrammarCompiler
from kvlab.tokenizer import IncrementalDetokenizer
from kvlab.tokenizer.chat import render_chat_template, template_variables

from fake_engine import FakeEngine, FakeTokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "units": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip",
        "parameters": {"type": "object", "properties": {
            "trip": {"type": "object"}, "travelers": {"type": "integer"},
            "note": {"type": "string"}}}}},
]
WEATHER = {"city": "Zürich", "units": "celsius"}
TRIP = {"trip": {"from": "東京", "to": "Paris", "legs": [{"mode": "train 🚄", "days": 2}]},
        "travelers": 2, "note": "fenêtre, s'il vous plaît"}
CALLS = [("get_weather", WEATHER), ("book_trip", TRIP)]
BEFORE = "Let me look that up — un momento."


def j(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def named(args_key: str = "arguments") -> list[dict]:
    return [{"name": n, args_key: a} for n, a in CALLS]


def xml_params(open_: str, close: str, value_open: str, value_close: str, args: dict) -> str:
    return "".join(f"{open_.format(k)}{value_open}{v if isinstance(v, str) else j(v)}"
                   f"{value_close}{close}" for k, v in args.items())


DS_R1 = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{j(a)}\n```"
                "<｜tool▁call▁end｜>\n" for n, a in CALLS)
HARMONY = "<|start|>assistant".join(
    f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{j(a)}<|call|>"
    for n, a in CALLS)
CODER = "".join(f"<tool_call>\n<function={n}>\n"
                f"{xml_params('<parameter={}>', '</parameter>' + chr(10), chr(10), chr(10), a)}"
                "</function>\n</tool_call>\n" for n, a in CALLS)
GLM_ARG = ("<arg_key>{}</arg_key>", "\n", "\n<arg_value>", "</arg_value>")
GLM = "".join(f"<tool_call>{n}\n{xml_params(*GLM_ARG, a)}</tool_call>\n" for n, a in CALLS)
KIMI = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{j(a)}"
               "<|tool_call_end|>" for i, (n, a) in enumerate(CALLS))



def gemma(value: object) -> str:
    """A value as Gemma 4's template writes call arguments (bare keys, <|"|> strings)."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma(v) for v in value) + "]"
    return j(value)


def python(value: object) -> str:
    """A keyword value as LFM2's template writes it (strings quoted, objects as JSON)."""
    return repr(value) if isinstance(value, str) else j(value) if isinstance(value, dict) \
        else str(value)


def invoke(prefix: str, n: str, args: dict, typed: bool) -> str:
    """MiniMax-M2's and DSML's invoke blocks (DSML marks string parameters)."""
    def attr(v: object) -> str:
        return (' string="true"' if isinstance(v, str) else ' string="false"') if typed else ""
    return (f'<{prefix}invoke name="{n}">\n' + "".join(
        f'<{prefix}parameter name="{k}"{attr(v)}>{v if isinstance(v, str) else j(v)}'
        f"</{prefix}parameter>\n" for k, v in args.items()) + f"</{prefix}invoke>\n")


def dsml(block: str) -> str:
    return (f"{BEFORE}\n\n<｜DSML｜{block}>\n"
            + "".join(invoke("｜DSML｜", n, a, True) for n, a in CALLS) + f"</｜DSML｜{block}>")


COMMAND_R = "Action:\n```json\n[\n" + ",\n".join(
    '    {\n        "tool_name": "' + n + '",\n        "parameters": '
    + json.dumps(a, indent=4, ensure_ascii=False).replace("\n", "\n        ") + "\n    }"
    for n, a in CALLS) + "\n]```\n"
SEED = "".join(f"\n<seed:tool_call>\n<function={n}>\n" + "".join(
    f"<parameter={k}>{v}</parameter>\n" for k, v in a.items())
    + "</function>\n</seed:tool_call>" for n, a in CALLS)

# format -> (reply, content of the whole parse)
REPLIES = {
    "qwen": (f"{BEFORE}\n\n" + "\n".join(f"<tool_call>\n{j(c)}\n</tool_call>"
                                       for c in named()), BEFORE),
    "qwen_text_after": (f"{BEFORE}\n" + "".join(f"<tool_call>{j(c)}</tool_call>" for c in named())
                        + "\nI will wait for both.  ", f"{BEFORE}\nI will wait for both."),
    "qwen3_coder": (f"{BEFORE}\n{CODER}", BEFORE),
    "llama": ("\n".join(j(c) for c in named("parameters")), None),
    "llama_python_tag": ("<|python_tag|>" + "; ".join(j(c) for c in named("parameters")),
                         None),
    "mistral": (f"{BEFORE}[TOOL_CALLS]{j([{**c, 'id': 'a1B2c3D4e'} for c in named()])}",
                BEFORE),
    "mistral_args": (f"{BEFORE}" + "".join(f"[TOOL_CALLS]{n}[ARGS]{j(a)}" for n, a in CALLS),
                     BEFORE),
    "deepseek_r1": (f"{BEFORE}\n\n<｜tool▁calls▁begin｜>{DS_R1}<｜tool▁calls▁end｜>", BEFORE),
    "deepseek_v3_1": (f"{BEFORE}<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{j(a)}<｜tool▁call▁end｜>" for n, a in CALLS)
        + "<｜tool▁calls▁end｜>", BEFORE),
    "gpt_oss": (f"{BEFORE}{HARMONY}", BEFORE),
    "glm": (f"{BEFORE}\n{GLM}", BEFORE),
    "kimi_k2": (f"{BEFORE}<|tool_calls_section_begin|>{KIMI}<|tool_calls_section_end|>",
                BEFORE),
    "granite": (f"{BEFORE}<|tool_call|>{j(named())}", BEFORE),
    "functools": (f"{BEFORE} functools{j(named())}", BEFORE),
    "functionary": (f"all\n{BEFORE}" + "".join(f">>>{n}\n{j(a)}" for n, a in CALLS), BEFORE),
    "functionary_v3_1": (f"{BEFORE}\n" + "".join(f"<function={n}>{j(a)}</function>"
                                                 for n, a in CALLS), BEFORE),
    "gemma4": (f"{BEFORE}" + "".join(f"<|tool_call>call:{n}{gemma(a)}<tool_call|>"
                                     for n, a in CALLS), BEFORE),
    "minimax_m2": (f"{BEFORE}\n<minimax:tool_call>\n" + "".join(
        invoke("", n, a, False) for n, a in CALLS) + "</minimax:tool_call>", BEFORE),
    "minimax_m1": (f"{BEFORE}\n<tool_calls>\n" + "\n".join(j(c) for c in named())
                   + "\n</tool_calls>", BEFORE),
    "deepseek_v3_2": (dsml("function_calls"), BEFORE),
    "deepseek_v3_2_v4": (dsml("tool_calls"), BEFORE),
    "seed_oss": (f"{BEFORE}\n{SEED}", BEFORE),
    "command_r": (f"{BEFORE}\n{COMMAND_R}", BEFORE),
    "command_r7b": (f"{BEFORE}<|START_ACTION|>[\n" + ",\n".join(
        f'    {{"tool_call_id": "{i}", "tool_name": "{n}", "parameters": {j(a)}}}'
        for i, (n, a) in enumerate(CALLS)) + "\n]<|END_ACTION|>", BEFORE),
    "lfm2": (f"{BEFORE}<|tool_call_start|>[" + ", ".join(
        f"{n}({', '.join(f'{k}={python(v)}' for k, v in a.items())})" for n, a in CALLS)
        + "]<|tool_call_end|>", BEFORE),
    "generic": (j(named()), None),
    "other": (f"{BEFORE}\n" + "".join(f"<tool_call>{j(c)}</tool_call>" for c in named()),
              BEFORE),
}


def plan_for(case: str, mode: str = "auto") -> ToolPlan:
    form = next(f for f in sorted(FORMATS, key=len, reverse=True) if case.startswith(f))
    plan = tool_plan(TOOLS, mode, None, form)
    assert plan is not None
    return plan


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = ToolStream(plan)
    shown = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    return shown + rest, calls


def test_every_format_has_a_reply() -> None:
    assert set(FORMATS) <= {plan_for(case).form for case in REPLIES}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_a_reply_parses_whole_into_its_calls(case: str) -> None:
    text, content = REPLIES[case]
    got_content, calls = parse_reply(text, plan_for(case))
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == CALLS
    assert all(c["type"] == "function" for c in calls)
    ids = [c["id"] for c in calls]
    if case.startswith("mistral"):
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    elif case == "kimi_k2":
        assert ids == ["functions.get_weather:0", "functions.book_trip:1"]
    else:
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == 2


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_streamed_equals_whole_at_every_cut(case: str) -> None:
    text, _ = REPLIES[case]
    plan = plan_for(case)
    content, calls = parse_reply(text, plan)
    whole = (content or "", calls_of(calls))
    for cut in range(len(text) + 1):
        shown, got = streamed(plan, [text[:cut], text[cut:]])
        assert (shown, calls_of(got)) == whole, f"cut at {cut}: {text[:cut]!r}"
    shown, got = streamed(plan, list(text))
    assert (shown, calls_of(got)) == whole


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_calls_are_named_and_their_arguments_grow_while_written(case: str) -> None:
    text, _ = REPLIES[case]
    plan = plan_for(case)
    whole = calls_of(parse_reply(text, plan)[1])
    stream = ToolStream(plan)
    seen: list[list[tuple[str, str]]] = []
    for c in text:
        stream.feed(c)
        seen.append(stream.partial_calls())
    for before, after in pairwise(seen):
        assert len(after) >= len(before)
        assert all(a[0] == b[0] and a[1].startswith(b[1]) for a, b in zip(after, before,
                                                                           strict=False))
    assert all(w[0] == p[0] and w[1].startswith(p[1]) for w, p in zip(whole, seen[-1],
                                                                       strict=False))
    if plan.call_format.heads is not None:  # JSON arguments: named, and grown, before the end
        assert [p[0] for p in seen[-1]] == [w[0] for w in whole]
        assert len(seen[-1][0][1]) > len(whole[0][1]) // 2
    assert calls_of(stream.finish()[1]) == whole


def test_text_before_a_call_streams_and_the_call_is_held() -> None:
    text, _ = REPLIES["qwen"]
    stream = ToolStream(plan_for("qwen"))
    shown = "".join(stream.feed(c) for c in text)
    assert shown == BEFORE and "<tool_call>" in stream.held


@pytest.mark.parametrize("form, text", [
    ("qwen", "Use <tool or <tool_call at the end: no call.   "),
    ("llama", "  The answer is {not json} <|python_ta"),
    ("generic", "[1, 2, 3] is a list, not a call."),
    ("mistral", "Plain words [TOOL_CALL] and [TOOL"),
    ("gpt_oss", "<|start|>assistant<|channel|>final<|message|>Hello, wörld! to=func"),
    ("functionary", "all\nSure — here is the answer.\n\n"),
    ("functionary", "al"),
    ("kimi_k2", "Nothing here <|tool_calls_sec"),
    ("gemma4", "Plain words, then <|tool_ca"),
    ("lfm2", "Use <|tool_call_start|>[not a call] here"),
    ("command_r", "Action: none needed, the answer is 4."),
    ("deepseek_v3_2", "A DSML block <｜DSML｜function_calls>\nthat holds no invoke"),
])
def test_replies_without_calls_stream_unchanged(form: str, text: str) -> None:
    plan = plan_for(form)
    content, calls = parse_reply(text, plan)
    assert calls == [] and content == text.removeprefix(FORMATS[form].lead)
    for cut in range(len(text) + 1):
        assert streamed(plan, [text[:cut], text[cut:]]) == (content, [])


def _bad_json(case: str, text: str) -> str:
    """The reply with its first call's arguments no longer valid JSON."""
    first = next(a for n, a in CALLS)
    if case in ("qwen3_coder", "glm"):
        return text.replace("<function=get_weather>", "<function=get_weathr>", 1) \
            .replace("<tool_call>get_weather", "<tool_call>get_weathr", 1)
    if j(first) in text:
        return text.replace(j(first)[:-1], j(first)[:-2] + ",", 1)
    if '"city": "Zürich"' in text:
        return text.replace('"city": "Zürich"', '"city": Zürich', 1)
    return text.replace("get_weather", "get_weathr", 1)  # arguments not JSON: the call's name


@pytest.mark.parametrize("case", sorted(REPLIES))
@pytest.mark.parametrize("damage", ["bad json", "unknown tool"])
def test_malformed_calls_stay_text(case: str, damage: str) -> None:
    text, _ = REPLIES[case]
    broken = _bad_json(case, text) if damage == "bad json" \
        else text.replace("book_trip", "launch_rocket")
    assert broken != text
    plan = plan_for(case)
    content, calls = parse_reply(broken, plan)
    assert calls == [] and content == broken.removeprefix(FORMATS[plan.form].lead)
    assert streamed(plan, list(broken)) == (content, [])


def test_required_mode_reads_the_familys_format_or_a_json_list() -> None:
    """A required call is held to the template's own format where the format can say the
    tools' arguments (the reply reads back in it), else to a JSON list."""
    text = j(named())
    own = {f for f in FORMATS if tool_plan(TOOLS, "required", None, f).native_grammar}
    assert own == set(FORMATS) - {"generic", "other", "gpt_oss"}
    for form in FORMATS:
        plan = tool_plan(TOOLS, "required", None, form)
        assert plan is not None
        if form in own:
            assert plan.structure(form).kind == "grammar" and plan.call_format.name == form
            continue
        calls = parse_reply(text, plan)[1]
        assert [json.loads(a) for _, a in calls_of(calls)] == [WEATHER, TRIP]
        stream = ToolStream(plan)
        assert stream.feed(text) == "" and len(stream.finish()[1]) == 2
    for form, ids in (("mistral", r"[A-Za-z0-9]{9}"), ("kimi_k2", r"functions\.\w+:\d")):
        plan = tool_plan(TOOLS, "required", None, form)
        reply = REPLIES[form][0][len(BEFORE):]  # ids as the template takes them back
        assert all(re.fullmatch(ids, c["id"]) for c in parse_reply(reply, plan)[1])


def test_xml_parameters_are_typed_by_the_tools_schema() -> None:
    plan = plan_for("qwen3_coder")
    reply = ("<tool_call>\n<function=book_trip>\n<parameter=travelers>\n3\n</parameter>\n"
             "<parameter=note>\n42\n</parameter>\n<parameter=trip>\nnot json\n</parameter>\n"
             "</function>\n</tool_call>")
    args = json.loads(parse_reply(reply, plan)[1][0]["function"]["arguments"])
    assert args == {"travelers": 3, "note": "42", "trip": "not json"}


# ---- detection from the real templates ---------------------------------------------------------

# template -> the format it teaches; every other template there gets "generic" (no `tools`)
# or "other" (tools, but a format none of the families above writes)
EXPECTED = {
    "qwen": ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B",
             "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
             "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "ibm-granite-granite-4.0"],
    "qwen3_coder": ["Qwen3-Coder", "Qwen3.5-4B", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"],
    "llama": ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
              "meta-llama-Llama-3.3-70B-Instruct"],
    "mistral": ["mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
                "mistralai-Ministral-3-14B-Reasoning-2512", "unsloth-mistral-Devstral-Small-2507"],
    "deepseek_r1": ["llama-cpp-deepseek-r1"],
    "gpt_oss": ["openai-gpt-oss-120b"],
    "glm": ["GLM-4.6", "GLM-4.7-Flash"],
    "kimi_k2": ["moonshotai-Kimi-K2", "Kimi-K2-Instruct", "Kimi-K2-Thinking"],
    "granite": ["ibm-granite-granite-3.3-2B-Instruct"],
    "functionary": ["meetkai-functionary-medium-v3.2"],
    "functionary_v3_1": ["meetkai-functionary-medium-v3.1"],
    "gemma4": ["google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved"],
    "minimax_m2": ["MiniMax-M2"],
    "minimax_m1": ["MiniMax-M1"],
    "deepseek_v3_2": ["deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4",
                      "deepseek-ai-DeepSeek-V4-Flash-0731"],
    "seed_oss": ["ByteDance-Seed-OSS"],
    "command_r": ["CohereForAI-c4ai-command-r-plus-tool_use"],
    "command_r7b": ["CohereForAI-c4ai-command-r7b-12-2024-tool_use", "Cohere2MoE"],
    "lfm2": ["LFM2-8B-A1B", "LFM2.5-8B-A1B"],
    "generic": ["google-gemma-2-2b-it", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                "microsoft-Phi-3.5-mini-instruct"],
}


def _template_folder() -> Path | None:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    found = Path(folder) / "templates" if folder else None
    return found if found and found.is_dir() else None


@pytest.mark.skipif(_template_folder() is None,
                    reason="set KVLAB_LLAMA_VOCABS to llama.cpp's models/ folder (its templates/ "
                           "holds real chat templates)")
def test_each_real_template_is_matched_to_its_format() -> None:
    folder = _template_folder()
    assert folder is not None
    got = {}
    for path in sorted(folder.glob("*.jinja")):
        template = path.read_text()
        got[path.stem] = detect_format(template, "tools" in template_variables(template))
    for form, names in EXPECTED.items():
        for name in names:
            assert got[name] == form, name
    assert set(got.values()) <= set(FORMATS)


# ---- through the four APIs ---------------------------------------------------------------------


class KimiTokenizer(FakeTokenizer):
    """The fake engine's tokenizer with a template that takes tools and teaches Kimi K2's
    calls (the fake engine writes its scripted reply whatever the prompt)."""

    chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                     "{% if tools %}{{ tools | tojson }}{% endif %}"
                     "<|tool_calls_section_begin|><|tool_call_begin|>")


def api_replies(reply: str) -> dict[str, object]:
    """The tool calls each API returns for `reply`, by API (OpenAI chat also streamed)."""
    user = [{"role": "user", "content": "Weather in Zürich, and book a trip?"}]
    answers: dict[str, object] = {}

    async def main() -> None:
        engine = FakeEngine(model_name="kimi.gguf", tokenizer=KimiTokenizer(), reply=reply)
        ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
        app = create_app(ae, front_ends(), limits=ServerLimits())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                await ask_all(client, user, answers)
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))
    return answers


async def ask_all(client: httpx.AsyncClient, user: list[dict], answers: dict) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": user, "tools": TOOLS})
    answers["chat"] = r.json()["choices"][0]["message"]
    r = await client.post("/v1/chat/completions",
                          json={"messages": user, "tools": TOOLS, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    answers["chat_stream"] = [d for c in chunks for d in c["choices"][0]["delta"]
                              .get("tool_calls", [])]
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    r = await client.post("/v1/responses", json={"input": user[0]["content"], "tools": flat})
    answers["responses"] = [i for i in r.json()["output"] if i["type"] == "function_call"]
    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"][
        "parameters"]} for t in TOOLS]
    r = await client.post("/v1/messages", json={"messages": user, "tools": anthropic_tools,
                                                "max_tokens": 2000, "model": "kimi.gguf"})
    answers["anthropic"] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    r = await client.post("/api/chat", json={"model": "kimi.gguf", "messages": user,
                                             "tools": TOOLS, "stream": False})
    answers["ollama"] = r.json()["message"].get("tool_calls", [])


def test_every_api_reads_calls_in_the_templates_format() -> None:
    reply, content = REPLIES["kimi_k2"]
    got = api_replies(reply)
    chat = got["chat"]
    assert chat["content"] == content
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in chat["tool_calls"]] == [
        ("functions.get_weather:0", "get_weather", WEATHER), ("functions.book_trip:1",
                                                             "book_trip", TRIP)]
    # streamed: each call's id and name once, then argument fragments that add up to the
    # whole reply's arguments
    streamed_calls: dict[int, dict] = {}
    for d in got["chat_stream"]:
        if "id" in d:
            streamed_calls[d["index"]] = {"id": d["id"], **d["function"], "pieces": 0}
        else:
            streamed_calls[d["index"]]["arguments"] += d["function"]["arguments"]
            streamed_calls[d["index"]]["pieces"] += 1
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed_calls.values()] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in chat["tool_calls"]]
    assert all(s["pieces"] > 5 for s in streamed_calls.values())
    assert [(i["name"], json.loads(i["arguments"])) for i in got["responses"]] == CALLS
    assert [(b["name"], b["input"]) for b in got["anthropic"]] == CALLS
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["ollama"]] \
        == CALLS


# ---- markers that are special tokens ------------------------------------------------------------


def test_marker_tokens_are_written_into_the_text_they_are_read_from() -> None:
    """Vocabularies hold many formats' markers as special tokens, which decoding leaves out;
    the served format's markers are kept in the generated text (here Gemma's turn markers
    stand in for them)."""
    tok = default_tokenizer()
    shown = list(special_markers(tok, ("<start_of_turn>", "<end_of_turn>", "not one token")).values())
    assert [tok.decode([i], skip_special_tokens=False) for i in shown] \
        == ["<start_of_turn>", "<end_of_turn>"]
    ids = tok.encode("<start_of_turn>model\nHi<end_of_turn><eos>", add_special_tokens=False)

    def text(detok: IncrementalDetokenizer) -> str:
        return "".join(detok.push(i) for i in ids) + detok.flush()
    assert text(IncrementalDetokenizer(tok)) == "model\nHi"
    assert text(IncrementalDetokenizer(tok, shown=frozenset(shown))) \
        == "<start_of_turn>model\nHi<end_of_turn>"
    assert SamplingParams(shown_special_ids=[105]).shown_special_ids == (105,)
    assert all(fmt.tokens or fmt.name in ("generic", "functools", "functionary",
                                          "functionary_v3_1", "command_r", "deepseek_v3_2")
               for fmt in FORMATS.values())


# ---- required calls held to the family's own format ---------------------------------------------

GRAMMAR_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": {
            "type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "description": "A city"},
                "days": {"type": "integer", "description": "How many days"}}}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book", "parameters": {
            "type": "object", "required": ["note"], "properties": {
                "travelers": {"type": "integer", "description": "How many"},
                "note": {"type": "string", "description": "For the agent"}}}}},
]
GRAMMAR_CALLS = [("get_weather", {"city": "Zürich", "days": 3}),
                 ("book_trip", {"travelers": 2, "note": "fenêtre, <vous> plaît"})]
# format -> a template that writes an assistant turn's calls as its reply is written (Mistral's
# puts the tools beside the last user turn and Granite 3.3's writes no calls, so their replies
# are not the tail of a rendered conversation)
RENDERED = {
    "qwen": "Qwen-Qwen2.5-7B-Instruct", "qwen3_coder": "Qwen3-Coder", "glm": "GLM-4.6",
    "kimi_k2": "moonshotai-Kimi-K2", "minimax_m2": "MiniMax-M2", "minimax_m1": "MiniMax-M1",
    "seed_oss": "ByteDance-Seed-OSS", "lfm2": "LFM2.5-8B-A1B",
    "llama": "meta-llama-Llama-3.1-8B-Instruct",
    "functionary_v3_1": "meetkai-functionary-medium-v3.1",
    "functionary": "meetkai-functionary-medium-v3.2",
    "deepseek_v3_2": "deepseek-ai-DeepSeek-V3.2", "gemma4": "google-gemma-4-31B-it",
    "command_r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
}


@cache
def compiler() -> GrammarCompiler:
    """Grammars compiled on the default model's vocabulary (its tables built once)."""
    tok = default_tokenizer()
    return GrammarCompiler(tok, tok.vocab_size)


def rendered_reply(template: str, calls: list) -> str:
    """The assistant turn the template writes for `calls`, as a reply (its reasoning block
    and what follows the calls left on)."""
    def render(messages: list[dict], prompt: bool, as_text: bool) -> str:
        written = [{"id": f"a1B2c3D4{i}", "type": "function", "function": {
            "name": n, "arguments": j(a) if as_text else a}} for i, (n, a) in enumerate(calls)]
        turn = [] if prompt else [{"role": "assistant", "content": "", "tool_calls": written}]
        return render_chat_template(template, messages + turn, add_generation_prompt=prompt,
                                    bos_token="<s>", eos_token="</s>", tools=GRAMMAR_TOOLS)
    user = [{"role": "user", "content": "Weather, and a trip?"}]
    try:
        prompt, full = render(user, True, False), render(user, False, False)
    except RequestError:  # functionary v3.2 takes arguments as JSON text
        prompt, full = render(user, True, True), render(user, False, True)
    same = next((k for k, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b),
                len(prompt))
    reply = full[max(full.rfind("\n", 0, same), full.rfind(">", 0, same)) + 1:]
    fmt = reasoning_format(template)
    if fmt is not None and fmt.end in reply:
        reply = split_reasoning(reply.removeprefix(fmt.end) if fmt.closes(prompt) else reply,
                                fmt, fmt.opens(prompt))[1]
    return reply.lstrip()


@pytest.mark.skipif(_template_folder() is None,
                    reason="set KVLAB_LLAMA_VOCABS to llama.cpp's models/ folder (its templates/ "
                           "holds real chat templates)")
@pytest.mark.parametrize("form", sorted(RENDERED))
def test_the_required_grammar_holds_the_calls_the_template_writes(form: str) -> None:
    """The grammar a required call gets accepts the calls as the family's real template
    writes them (up to the end of the turn), and they read back as the calls."""
    folder = _template_folder()
    assert folder is not None
    template = (folder / f"{RENDERED[form]}.jinja").read_text()
    assert detect_format(template, True) == form
    calls = GRAMMAR_CALLS[:1] if form == "llama" else GRAMMAR_CALLS  # Llama: one at a time
    reply = rendered_reply(template, calls)
    plan = tool_plan(GRAMMAR_TOOLS, "required", None, form)
    assert plan is not None and plan.native_grammar is not None
    tok = default_tokenizer()
    start = compiler().compile(Structure("grammar", plan.native_grammar))
    accepted = None
    for cut in range(len(reply), 0, -1):  # the longest start of the reply the grammar ends
        matcher = start.deep_copy()
        ids = tok.encode(reply[:cut], add_special_tokens=False)
        if matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting():
            accepted = reply[:cut]
            break
    assert accepted is not None, reply
    assert reply[len(accepted):].strip() == "" or not reply[len(accepted):].startswith(
        tuple(FORMATS[form].markers) or ("\0",))
    got = parse_reply(accepted, plan)[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
        == calls


def test_required_grammars_compile_for_every_format() -> None:
    """Every format's grammar compiles on a real vocabulary for one call and for several, with
    open objects and choices among the parameters."""
    choice = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]},
                                         "flags": {"type": "array",
                                                   "items": {"type": "boolean"}}}}}}
    for form in FORMATS:
        for tools, choice_of in ((TOOLS + [choice], "required"),
                                 (TOOLS, {"type": "function",
                                          "function": {"name": "book_trip"}})):
            plan = tool_plan(tools, choice_of, None, form)
            assert plan is not None
            if plan.native_grammar is not None:
                compiler().compile(Structure("grammar", plan.native_grammar))
