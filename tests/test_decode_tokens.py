"""A decode step's plain tokens as one DecodeTokens (columns) instead of a CoreOutput per
request: the output processor makes of a run exactly what it makes of the run's rows one by
one (table hits, stop strings, tokens whose text is not known yet, dropped requests, full
outputs between runs, outputs read late), and an async engine's steps give the same
RequestOutputs as the synchronous engine's."""

from __future__ import annotations

import dataclasses

import pytest
from test_tokenizer_gemma import default_tokenizer

from kvlab.engine import Engine, EngineConfig
from kvlab.output import OutputProcessor
from kvlab.request import CoreOutput, DecodeTokens, FinishReason, RequestOutput, SamplingParams

from tiny_models import build

IDS = ["plain", "stops", "gone", "late"]


def fresh(tok) -> OutputProcessor:
    proc = OutputProcessor(tok)
    for rid in IDS:
        proc.add(rid, SamplingParams(stop=("zz",) if rid == "stops" else ()), arrival=1.0)
    return proc


def first_tokens(proc: OutputProcessor, ids: list[int]) -> None:
    """Each request's first output, through the full path (it sets `plain`)."""
    proc.process([CoreOutput(rid, [t], None, 3, 1, 1, 2.0, scheduled=1.5,
                             prefill_seconds=0.25) for rid, t in zip(IDS, ids)])


def columns(rids: list[str], ids: list[int], n_out: int, now: float) -> DecodeTokens:
    n = len(rids)
    return DecodeTokens(rids, ids, [n_out] * n, [3] * n, [1] * n, [1.5] * n, [0.25] * n, now)


def view(outs: list[RequestOutput]) -> list[tuple]:
    """Every field, and the timings but for the wall-clock time a request finished at."""
    return [(dataclasses.replace(o, timings=None), o.timings.scheduled, o.timings.first_token,
             o.timings.token_times, o.timings.prefill_seconds) for o in outs]


def test_a_row_is_the_core_output_built_by_keyword():
    """row() builds positionally: a field added to CoreOutput out of its order breaks this."""
    tokens = DecodeTokens(["a", "b"], [7, 8], [2, 5], [3, 4], [1, 0], [1.5, None], [0.25, 0.0],
                          6.0)
    assert tokens.row(1) == CoreOutput(
        request_id="b", new_token_ids=[8], finish_reason=None, prompt_tokens=4,
        cached_tokens=0, output_tokens=5, step_time=6.0, logprobs=[], stop_token=False,
        scheduled=None, prefill_seconds=0.0, forced_tokens=0, draft_tokens=0,
        accepted_tokens=0, allowed_tokens=None, experts=None)


def test_plain_outputs_are_the_request_outputs_built_by_keyword():
    """A table hit's RequestOutput, from columns and from a CoreOutput, both built
    positionally: a field added to RequestOutput out of their order breaks this."""
    tok = default_tokenizer()
    hello = tok.encode(" hello")[-1]
    proc = fresh(tok)
    first_tokens(proc, [hello] * 4)
    assert proc.texts.known.get(hello) == " hello"  # both take the table look-up
    got = [proc.process([columns(["plain"], [hello], 2, 3.0)]).outputs[0],
           proc.process([CoreOutput("plain", [hello], None, 3, 1, 3, 4.0, scheduled=1.5,
                                    prefill_seconds=0.25)]).outputs[0]]
    t = proc._states["plain"].timings
    assert got == [RequestOutput(
        request_id="plain", new_token_ids=[hello], text_delta=" hello", finished=False,
        finish_reason=None, prompt_tokens=3, cached_tokens=1, output_tokens=n, logprobs=[],
        timings=t, forced_tokens=0, draft_tokens=0, accepted_tokens=0, allowed_tokens=None,
        experts=None) for n in (2, 3)]
    assert (t.scheduled, t.prefill_seconds, t.token_times) == (1.5, 0.25, [2.0, 3.0, 4.0])


def by_rows(items: list) -> list[CoreOutput]:
    return [c for item in items for c in
            ([item.row(i) for i in range(len(item))] if isinstance(item, DecodeTokens)
             else [item])]


def test_a_run_of_columns_is_processed_as_its_rows():
    tok = default_tokenizer()
    hello, world = tok.encode(" hello")[-1], tok.encode(" world")[-1]  # after any BOS
    a, b = fresh(tok), fresh(tok)
    for proc in (a, b):
        first_tokens(proc, [hello] * 4)
        proc.drop("gone")
    unseen = tok.encode(" zebra")[-1]  # its text is not in the table yet: the full path
    steps = [
        [columns(IDS, [world, hello, world, unseen], 2, 3.0)],
        [columns(IDS[:2], [world] * 2, 3, 4.0),
         CoreOutput("late", [hello], FinishReason.LENGTH, 3, 1, 3, 4.0),
         columns(IDS[2:3], [world], 3, 4.0)],
        [columns(["plain", "stops"], [unseen, world], 4, 5.0)],
    ]
    late = []
    for items in steps:
        columnar, rows = a.process(items), b.process(by_rows(items))
        late.append(columnar)  # read after the later steps ran
        assert columnar.stopped == rows.stopped
        assert columnar.outputs is columnar.outputs  # built once
    replay = fresh(tok)
    first_tokens(replay, [hello] * 4)
    replay.drop("gone")
    expected = [replay.process(by_rows(items)).outputs for items in steps]
    assert [view(p.outputs) for p in late] == [view(step) for step in expected]
    assert [o.request_id for o in expected[1]] == ["plain", "stops", "late"]
    # "stops" holds text back that could begin its stop string
    assert [o.text_delta for o in expected[0]] == [" world", "o hell", " zebra"]
    assert a.num_live == b.num_live == 2  # "late" ended, "gone" was dropped


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    build("llama", out)
    return out / "model.gguf"


def outputs(path, async_on: bool) -> tuple[dict[str, list[tuple]], int]:
    """Each request's RequestOutputs (timings aside) through core_step and the processor,
    and how many DecodeTokens the core emitted."""
    e = Engine.from_model(str(path), EngineConfig(block_size=4, async_scheduling=async_on))
    jobs = {"a": SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
            "b": SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            "c": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2),
            "d": SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)}
    for i, (rid, params) in enumerate(jobs.items()):
        e.add_request(rid, [5 + i, 17, 40 + 3 * i, 9], params)
    seen: dict[str, list[tuple]] = {rid: [] for rid in jobs}
    columnar = 0
    while e.has_unfinished():
        items = e.core_step()
        columnar += sum(isinstance(item, DecodeTokens) for item in items)
        for out in e.outputs.process(items).outputs:
            fields = dataclasses.asdict(out)
            del fields["timings"]
            fields["logprobs"] = [(lp["token_id"], round(lp["logprob"], 4))
                                  for lp in fields["logprobs"]]
            seen[out.request_id].append(tuple(fields.items()))
    e.close()
    return seen, columnar


def test_async_steps_give_the_synchronous_outputs(tiny):
    off, none = outputs(tiny, False)
    on, columnar = outputs(tiny, True)
    assert none == 0 and columnar > 0
    assert on == off
    assert [len(v) for v in on.values()] == [9, 4, 7, 8]
