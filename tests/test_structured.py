"""Structured outputs on the real default model: every output of many schemas validates with
`jsonschema`, greedy and sampled; regexes, choices and grammars match; batching, preemption,
seeds, logprobs, stops and max_tokens behave as without a structure; fixed keys are forced."""

from __future__ import annotations

import json
import re

import pytest

from kvlab.engine import Engine, EngineConfig
from kvlab.errors import RequestError
from kvlab.llm import LLM
from kvlab.request import SamplingParams, Structure

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = {
    "nested": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}}, "required": ["person"]},
    "array_bounds": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
        "maxItems": 3}}, "required": ["tags"]},
    "enum_const": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                    "version": {"const": 2}},
                   "required": ["color", "version"]},
    "number_bounds": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["price", "count"]},
    "pattern_format": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "day": {"type": "string", "format": "date"}}, "required": ["code", "day"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]}},
        "required": ["value"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                         "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"],
                                                           "maxLength": 15}},
                 "required": ["note"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 50}, "minItems": 2, "maxItems": 4},
    "unicode_keys": {"type": "object", "properties": {"名前": NAME, "größe": {
        "type": "integer", "minimum": 0, "maximum": 300}}, "required": ["名前", "größe"]},
}
PROMPT = "Reply with a JSON value.\n"


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(str(default_model_path))


def schema_params(name: str, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, **kw},
                          structured=Structure("json_schema", json.dumps(SCHEMAS[name])))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_output_validates(llm: LLM, temperature: float) -> None:
    names = list(SCHEMAS)
    outs = [llm.generate([PROMPT], schema_params(n, temperature=temperature, seed=7))[0]
            for n in names]
    for name, out in zip(names, outs):
        assert out.finish_reason.value == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_regex_choice_and_grammar_match(llm: LLM) -> None:
    cases = [
        (Structure("regex", r"[0-9]{3}-[0-9]{4}"), re.compile(r"[0-9]{3}-[0-9]{4}")),
        (Structure("choice", json.dumps(["yes", "no", "maybe"])), re.compile("yes|no|maybe")),
        (Structure("grammar", 'root ::= "The answer is " [0-9]+ "."'),
         re.compile(r"The answer is [0-9]+\.")),
        (Structure("json_object"), None),
    ]
    for temperature in (0.0, 1.0):
        for structure, pattern in cases:
            out = llm.generate(["Question: is it? Answer:"], SamplingParams(
                max_tokens=60, temperature=temperature, seed=3, structured=structure))[0]
            if pattern is None:  # any object: unbounded, the model may run to max_tokens
                assert out.text.startswith("{")
                if out.finish_reason.value == "stop":
                    assert isinstance(json.loads(out.text), dict)
            else:
                assert out.finish_reason.value == "stop", (structure, out.text)
                assert pattern.fullmatch(out.text), (structure, out.text)


def test_batched_equals_alone_and_seeds_repeat(llm: LLM) -> None:
    names = ["nested", "refs", "enum_const", "array_bounds"]
    alone = [llm.generate([PROMPT], schema_params(n))[0].text for n in names]
    engine = llm.engine
    for i, n in enumerate(names):
        engine.add_request(f"b{i}", PROMPT, schema_params(n))
    texts = {f"b{i}": "" for i in range(len(names))}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
    assert [texts[f"b{i}"] for i in range(len(names))] == alone
    sampled = [llm.generate([PROMPT], schema_params("nested", temperature=1.0, seed=11))[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_preempted_constrained_requests_still_validate(default_model_path,
                                                       monkeypatch) -> None:
    # 10 blocks of 16 tokens: eight running requests cannot all keep their KV: preemptions
    engine = Engine.from_model(str(default_model_path), EngineConfig(
        kv_cache_gib=10 * 16 * 36864 / 2**30, max_num_seqs=8, kv_dtype="f32"))  # 36864 B/token
    preempted = []
    original = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt",
                        lambda seq: (preempted.append(seq.seq_id), original(seq)))
    names = ["nested", "refs", "unicode_keys", "number_bounds"] * 3
    for i, n in enumerate(names):
        engine.add_request(f"p{i}", PROMPT, schema_params(n, temperature=1.0, seed=i))
    texts, reasons = {f"p{i}": "" for i in range(len(names))}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason.value
    assert preempted
    for i, n in enumerate(names):
        assert reasons[f"p{i}"] == "stop", texts[f"p{i}"]
        jsonschema.validate(json.loads(texts[f"p{i}"]), SCHEMAS[n])


def test_fixed_keys_are_forced_and_limits_still_apply(default_model_path) -> None:
    engine = Engine.from_model(str(default_model_path), EngineConfig())
    schema = {"type": "object", "properties": {
        "customer_full_name_as_written": NAME,
        "customer_account_number": {"type": "integer", "minimum": 0, "maximum": 9999}},
        "required": ["customer_full_name_as_written", "customer_account_number"]}
    params = SamplingParams(max_tokens=80, temperature=0, logprobs=1,
                            structured=Structure("json_schema", json.dumps(schema)))
    engine.add_request("f", "An order as JSON:", params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    last = outs[-1]
    assert last.finish_reason.value == "stop" and last.forced_tokens >= 8
    assert len(outs) < last.output_tokens  # fewer steps than tokens: forced ones came in chunks
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert len(logprobs) == last.output_tokens
    assert sum(lp.logprob == 0.0 for lp in logprobs) >= last.forced_tokens
    text = "".join(o.text_delta for o in outs)
    jsonschema.validate(json.loads(text), schema)
    engine.add_request("short", "An order as JSON:", SamplingParams(
        max_tokens=5, temperature=0, structured=params.structured))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason.value == "length" and outs[-1].output_tokens == 5
    engine.add_request("stop", "An order as JSON:", SamplingParams(
        max_tokens=80, temperature=0, stop=("account",), structured=params.structured))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    assert "account" not in text and text.startswith('{"customer_full_name')


def test_bad_structures_are_request_errors(llm: LLM) -> None:
    for structure, needle in [
        (Structure("json_schema", '{"type": "foo"}'), "foo"),
        (Structure("json_schema", "{not json"), "not valid JSON"),
        (Structure("json_schema", '{"type": "object", "not": {}}'), "not"),
        (Structure("regex", "(abc"), "unclosed"),
        (Structure("grammar", "root ::= missing_rule"), "missing_rule"),
        (Structure("choice", "[]"), "non-empty"),
    ]:
        with pytest.raises(RequestError, match=re.escape(needle)):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured=structure))
    assert not llm.engine.has_unfinished()


def test_auto_tool_replies_are_text_or_valid_calls(llm: LLM) -> None:
    from kvlab.server.core.tools import tool_plan

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}}}
    plan = tool_plan([weather], "auto", None)
    structured, tok = llm.engine.structured, llm.engine.tokenizer

    def accepted(form: str, text: str) -> bool:
        structured.start("t", structured.compiler.compile(plan.structure(form)))
        try:
            return all(structured.accept("t", t) for t in tok.encode(text, False))
        finally:
            structured.release("t")

    good = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    not_a_tool = '{"name": "get_time", "arguments": {}}'
    bad_args = '{"name": "get_weather", "arguments": {"town": "Oslo"}}'
    for form, wrap in (("generic", "[{}]"), ("qwen", ("Let me look.\n<tool_call>\n{}\n"
                                                     "</tool_call>")), ("llama", "{}")):
        as_written = (lambda t: t.replace('"arguments"', '"parameters"')) if form == "llama" \
            else (lambda t: t)
        assert accepted(form, "Hello! It is sunny in Oslo today.")
        assert accepted(form, wrap.replace("{}", as_written(good)))
        assert not accepted(form, wrap.replace("{}", as_written(not_a_tool)))
        assert not accepted(form, wrap.replace("{}", as_written(bad_args)))
    out = llm.generate(["Say hello."], SamplingParams(
        max_tokens=12, temperature=0, structured=plan.structure("generic")))[0]
    assert out.text and not out.text.lstrip().startswith("[")
