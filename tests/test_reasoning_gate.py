"""The reasoning gate: its state machine and index arithmetic (markers of one and of several
tokens, budgets, the whitespace gap), then on the real default model a JSON schema that
applies after the reasoning block, its end marker forced at the budget, and through the chat
route a thinking template's reply split into reasoning_content and JSON content."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvlab.cli.main import build_parser
from kvlab.cli.serve import server_limits
from kvlab.errors import KvlabError, RequestError
from kvlab.request import ReasoningGate, SamplingParams, Structure
from kvlab.server.anthropic.messages import MessagesCall
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.guard import ServerLimits
from kvlab.structured.gate import MAX_GAP, GateState, Phase

from fake_engine import FakeEngine, FakeTokenizer

START, END = (1,), (2,)  # one token each, as `<think>` / `</think>` often are
A, B, C = 7, 8, 9  # a three-token end marker
SPACE = 5


def state(**kw) -> GateState:
    return GateState(ReasoningGate(**{"start_ids": START, "end_ids": END, **kw}))


def feed(gate: GateState, tokens: list[int]) -> list[bool]:
    return [gate.take(t, t == SPACE) for t in tokens]


def test_the_block_opens_on_the_start_marker_and_ends_on_the_end_marker() -> None:
    g = state()
    assert g.phase is Phase.BEFORE and g.extras() == ((1,), True)
    assert feed(g, [SPACE, 1, 40, 41, 2]) == [True] * 5
    assert g.phase is Phase.GAP and g.used == 3 and g.forced(10) == []
    assert feed(g, [SPACE, SPACE, 42]) == [True, True, False]
    assert g.phase is Phase.STRUCTURE and g.extras() == ((), False)
    assert not g.take(SPACE, True)  # once started, the structure has every token


def test_a_reply_that_does_not_open_the_block_is_the_structures_from_its_first_token() -> None:
    g = state()
    assert feed(g, [42]) == [False] and g.phase is Phase.STRUCTURE


def test_inside_starts_in_the_block_and_never_ends_without_its_marker() -> None:
    g = state(inside=True)
    assert g.free and feed(g, [40] * 50) == [True] * 50
    assert g.phase is Phase.REASONING and g.forced(10) == []


def test_gap_whitespace_is_bounded() -> None:
    g = state(inside=True)
    feed(g, [2])
    assert feed(g, [SPACE] * MAX_GAP) == [True] * MAX_GAP
    assert g.extras() == ((), False)
    assert feed(g, [SPACE]) == [False] and g.phase is Phase.STRUCTURE


def test_a_multi_token_end_marker_is_matched_across_tokens() -> None:
    g = state(end_ids=(A, B, C), inside=True)
    feed(g, [A, B, 40, A, B])
    assert g.phase is Phase.REASONING
    feed(g, [C])
    assert g.phase is Phase.GAP and g.used == 6


@pytest.mark.parametrize("tokens,forced", [
    ([40, 41, 42, 43], [A, B, C]),  # the budget's last token began nothing
    ([40, 41, 42, A], [B, C]),  # ... began the marker: only the rest is forced
    ([40, 41, A, B], [C]),
    ([40, A, B, A], [B, C]),  # the longest overlap, not the first
])
def test_the_budget_forces_what_is_left_of_the_end_marker(tokens, forced) -> None:
    g = state(end_ids=(A, B, C), inside=True, budget=4)
    feed(g, tokens[:-1])
    assert g.free and g.forced(10) == []
    feed(g, tokens[-1:])
    assert g.over_budget and g.forced(10) == forced
    assert g.phase is Phase.GAP and not g.over_budget


def test_forcing_stops_at_the_room_left_and_resumes_under_the_mask() -> None:
    g = state(end_ids=(A, B, C), inside=True, budget=1)
    feed(g, [40])
    assert g.forced(1) == [A]
    assert g.over_budget and g.next_end_token() == B  # the sampler may draw only B
    feed(g, [B])
    assert g.forced(5) == [C] and g.phase is Phase.GAP


def test_a_start_marker_of_several_tokens_is_finished_by_force() -> None:
    g = state(start_ids=(3, 4), budget=0)
    assert g.extras() == ((3,), True)
    assert feed(g, [3]) == [True]
    assert g.forced(10) == [4, 2]  # the rest of the start, then the end: the budget is 0
    assert g.phase is Phase.GAP and g.used == 0


def test_a_zero_budget_inside_allows_only_the_end_marker() -> None:
    g = state(end_ids=(A, B), inside=True, budget=0)
    assert g.over_budget and not g.free and g.next_end_token() == A
    feed(g, [A])
    assert g.forced(10) == [B] and g.phase is Phase.GAP


def test_bad_gates_are_refused() -> None:
    with pytest.raises(RequestError, match="end marker"):
        ReasoningGate(start_ids=(1,), end_ids=())
    with pytest.raises(RequestError, match="start marker"):
        ReasoningGate(start_ids=(), end_ids=(2,))
    with pytest.raises(RequestError, match="budget"):
        ReasoningGate(start_ids=(1,), end_ids=(2,), budget=-1)


class ThinkingTokenizer(FakeTokenizer):
    chat_template = "{{ messages }}{% if not enable_thinking %}<think></think>{% endif %}"


def serving_of(tokenizer: FakeTokenizer, budget: int | None = None):
    engine = AsyncEngine(FakeEngine(tokenizer=tokenizer), max_waiting=1)  # type: ignore[arg-type]
    return create_app(engine, front_ends(), ServerLimits(reasoning_budget=budget)).state.serving


def test_serving_gates_thinking_prompts_only() -> None:
    serving = serving_of(ThinkingTokenizer())
    ids = serving.tokenizer.encode
    opened = serving.reasoning_gate(ids("Q?<think>\n"), structured=True)
    assert opened == ReasoningGate(ids("<think>"), ids("</think>"), inside=True)
    assert not serving.reasoning_gate(ids("Q?"), structured=True).inside  # may open it
    assert serving.reasoning_gate(ids("Q?<think></think>"), structured=True) is None  # off
    assert serving.reasoning_gate(ids("Q?"), structured=True, chat=False) is None  # raw
    assert serving.reasoning_gate(ids("Q?<think>"), structured=False) is None  # no need
    assert serving_of(FakeTokenizer()).reasoning_gate(ids("Q?<think>"), True, 5) is None


def test_the_budget_is_the_smaller_of_the_servers_and_the_requests() -> None:
    serving = serving_of(ThinkingTokenizer(), budget=100)
    ids = serving.tokenizer.encode("Q?<think>")
    assert serving.reasoning_gate(ids, structured=False).budget == 100
    assert serving.reasoning_gate(ids, structured=False, budget=30).budget == 30
    [request] = serving.engine_requests([ids], [SamplingParams()], reasoning_budget=300)
    assert request.params.reasoning.budget == 100



def test_kvlab_serve_reasoning_budget_flag() -> None:
    args = build_parser(["serve"]).parse_args(["serve", "--reasoning-budget", "64"])
    assert server_limits(args).reasoning_budget == 64
    args = build_parser(["serve"]).parse_args(["serve"])
    assert server_limits(args).reasoning_budget is None
    with pytest.raises(KvlabError, match="--reasoning-budget must be >= 0 tokens, got -1"):
        ServerLimits(reasoning_budget=-1)


def test_anthropic_budget_tokens_end_the_reasoning() -> None:
    serving = serving_of(ThinkingTokenizer(), budget=4096)
    body = {"model": "fake.gguf", "max_tokens": 2000, "thinking": {
        "type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Q?<think>"}]}
    call = MessagesCall.build(serving, json.dumps(body).encode())
    assert call.request.params.reasoning.budget == 1024


# ---- on the real default model (gemma-3: `<think>` / `</think>` are three tokens each) ------

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
PERSON = Structure("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(default_model_path):
    from kvlab.engine import Engine, EngineConfig
    return Engine.from_model(str(default_model_path), EngineConfig())


def markers(engine) -> tuple[list[int], list[int]]:
    encode = engine.tokenizer.encode
    return (encode("<think>", add_special_tokens=False),
            encode("</think>", add_special_tokens=False))


def run(engine, prompt: str, params: SamplingParams) -> tuple[list[int], str, str]:
    """(output ids, text, finish reason) of one request run alone."""
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert not engine.structured.constrained("r")  # released with the request
    ids = [t for o in outs for t in o.new_token_ids]
    return ids, "".join(o.text_delta for o in outs), outs[-1].finish_reason.value


@pytest.mark.slow
def test_the_schema_applies_after_the_block_its_end_forced_at_the_budget(engine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    start, end = markers(engine)
    gate = ReasoningGate(start_ids=start, end_ids=end, inside=True, budget=6)
    ids, text, reason = run(engine, "Think about a person, then describe them as JSON.\n"
                            "<think>\n", SamplingParams(max_tokens=80, temperature=0,
                                                        structured=PERSON, reasoning=gate))
    assert reason == "stop" and end not in [ids[i:i + 3] for i in range(6)]
    assert ids[6:9] == end  # six free tokens, then the marker by force
    thought, _, answer = text.partition("</think>")
    assert thought and answer.lstrip().startswith("{")  # whitespace may come between
    jsonschema.validate(json.loads(answer), SCHEMA)
    # without the gate the same request is constrained from its first token
    _, plain, _ = run(engine, "Think about a person, then describe them as JSON.\n<think>\n",
                      SamplingParams(max_tokens=80, temperature=0, structured=PERSON))
    assert plain.startswith("{") and "</think>" not in plain
    jsonschema.validate(json.loads(plain), SCHEMA)


@pytest.mark.slow
def test_a_reply_that_opens_the_block_itself_and_a_budget_without_structure(engine) -> None:
    start, end = markers(engine)
    gate = ReasoningGate(start_ids=start, end_ids=end, budget=3)
    # the start marker's first token beside the schema's: the bias makes the reply take it
    ids, text, _ = run(engine, "A person as JSON:\n", SamplingParams(
        max_tokens=60, temperature=0, structured=PERSON, reasoning=gate,
        logit_bias={start[0]: 100.0}))
    assert ids[:3] == start and ids[6:9] == end
    json.loads(text.partition("</think>")[2])
    ids, text, _ = run(engine, "Tell me a story.\n<think>\n", SamplingParams(
        max_tokens=20, temperature=0, reasoning=ReasoningGate(start, end, True, 5)))
    assert ids[5:8] == end and len(ids) == 20  # the block ends by force, then free text


# a thinking template on the default model: the generation prompt opens the block
THINKING = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n<think>\n"
            "{% endif %}{# the reply closes its reasoning with </think> #}")


def chat(engine, limits: ServerLimits, body: dict) -> dict:
    result = []

    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=4)
        app = create_app(ae, front_ends(), limits)
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=120) as client:
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Describe a person."}],
                    "temperature": 0, **body})
                assert r.status_code == 200, r.text
                result.append(r.json())
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=300))
    return result[0]


@pytest.mark.slow
def test_a_thinking_chat_gets_reasoning_content_and_schema_valid_content(
        default_model_path) -> None:
    from kvlab.engine import Engine, EngineConfig
    jsonschema = pytest.importorskip("jsonschema")
    engine = Engine.from_model(str(default_model_path), EngineConfig(chat_template=THINKING))
    schema_format = {"type": "json_schema", "json_schema": {"name": "person",
                                                            "schema": SCHEMA}}
    body = chat(engine, ServerLimits(reasoning_budget=8),
                {"max_tokens": 80, "response_format": schema_format})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"]  # eight free tokens of reasoning
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_markers_that_are_one_special_token_each(engine) -> None:
    """As `<think>` / `</think>` are in most thinking vocabularies: no grammar allows them,
    so the gate adds the start marker beside the schema's tokens and forces the end."""
    jsonschema = pytest.importorskip("jsonschema")
    encode = engine.tokenizer.encode
    start, end = encode("<unused0>", add_special_tokens=False), encode(
        "<unused1>", add_special_tokens=False)
    assert len(start) == len(end) == 1 and engine.tokenizer.is_special(start[0])
    gate = ReasoningGate(start_ids=start, end_ids=end, budget=5)
    ids, text, reason = run(engine, "A person as JSON:\n", SamplingParams(
        max_tokens=60, temperature=0, structured=PERSON, reasoning=gate,
        logit_bias={start[0]: 100.0}))
    assert ids[0] == start[0] and ids[6] == end[0] and reason == "stop"
    answer = engine.tokenizer.decode(ids[7:])  # the specials are not in the text
    jsonschema.validate(json.loads(answer), SCHEMA)
