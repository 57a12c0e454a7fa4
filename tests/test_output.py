"""The output processor apart from the engine core: stop strings found over several steps,
tokens the core made after a stop never shown nor counted, include_stop_str_in_output,
logprobs cut at the stop; on the real engine, the processor a step behind the core gives what
Engine.step gives, and the server's AsyncEngine makes the text of many requests on its output
thread."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from test_tokenizer_gemma import default_tokenizer

from kvlab.engine import Engine, EngineConfig
from kvlab.output import OutputProcessor
from kvlab.request import CoreOutput, FinishReason, RequestOutput, SamplingParams, TokenLogprob
from kvlab.server.core.async_engine import AsyncEngine, EngineRequest, EngineStepError
from kvlab.tokenizer import IncrementalDetokenizer

TEXT = "Sure, here it is.\nUser: and then some more"
STOP = "\nUser:"


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def core(ids: list[int], before: int, finish: FinishReason | None = None,
         stop_token: bool = False, logprobs: bool = False) -> CoreOutput:
    """One core step's output for request "r": `ids` after `before` output tokens."""
    lps = [TokenLogprob(t, -0.5 * (before + i), [(t, -0.5 * (before + i))])
           for i, t in enumerate(ids)] if logprobs else []
    return CoreOutput("r", list(ids), finish, prompt_tokens=3, cached_tokens=0,
                      output_tokens=before + len(ids), step_time=float(before + len(ids)),
                      logprobs=lps, stop_token=stop_token)


def feed(proc: OutputProcessor, steps: list[list[int]], **kw) -> tuple[list[RequestOutput],
                                                                       list[str]]:
    outs, stopped, n = [], [], 0
    for ids in steps:
        done = proc.process([core(ids, n, **kw)])
        outs += done.outputs
        stopped += done.stopped
        n += len(ids)
    return outs, stopped


def stop_span(tok, ids: list[int]) -> tuple[int, int]:
    """Indexes of the first and the last token holding part of STOP in TEXT's ids."""
    at = TEXT.index(STOP)
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    first = next(i for i, e in enumerate(ends) if e > at)
    last = next(i for i, e in enumerate(ends) if e >= at + len(STOP))
    return first, last


def test_stop_string_over_several_steps(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    first, last = stop_span(tok, ids)
    assert last > first, "the stop string must span tokens of different steps"
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(stop=(STOP,)), arrival=0.0)
    outs, stopped = feed(proc, [[t] for t in ids])
    assert len(outs) == last + 1 and stopped == ["r"]  # nothing after the stop's last token
    assert "".join(o.text_delta for o in outs) == TEXT[:TEXT.index(STOP)]
    assert all(STOP[:2] not in o.text_delta for o in outs)  # its start was held back
    final = outs[-1]
    assert final.finished and final.finish_reason == FinishReason.STOP
    assert final.output_tokens == last + 1 and final.timings is not None
    assert len(final.timings.token_times) == last + 1
    assert proc.num_live == 0


@pytest.mark.parametrize("include", [False, True])
def test_tokens_after_the_stop_are_dropped(tok, include):
    """The core made tokens past the stop, in the stop's step (a verified run) and in the
    next one (it ran before the processor's abort reached it): none is shown or counted."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    _, last = stop_span(tok, ids)
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(stop=(STOP,), include_stop_str_in_output=include,
                                 logprobs=1), arrival=0.0)
    steps = [ids[:last - 1], ids[last - 1:last + 2], ids[last + 2:last + 3]]
    outs, stopped = feed(proc, steps, logprobs=True)
    assert len(outs) == 2 and stopped == ["r"]  # the third step's output is dropped
    cut = TEXT.index(STOP) + (len(STOP) if include else 0)
    assert "".join(o.text_delta for o in outs) == TEXT[:cut]
    final = outs[-1]
    assert final.new_token_ids == ids[last - 1:last + 1]
    assert final.output_tokens == last + 1
    assert [lp.token_id for lp in final.logprobs] == final.new_token_ids
    assert [lp.logprob for lp in final.logprobs] == [-0.5 * (last - 1), -0.5 * last]
    assert final.timings is not None and final.timings.token_times[-1] == float(last + 2)
    assert len(final.timings.token_times) == last + 1


def test_a_stop_token_flushes_what_the_stop_filter_held(tok):
    """EOS after a partial stop string: the held text is written, EOS counted but not."""
    ids = tok.encode("Hello\nUs", add_special_tokens=False)
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(stop=(STOP,)), arrival=0.0)
    outs, stopped = feed(proc, [[t] for t in ids])
    eos = tok.eos_ids[0]
    final = proc.process([core([eos], len(ids), FinishReason.STOP, stop_token=True)])
    assert stopped == [] and final.stopped == []  # the core ended it itself
    out = final.outputs[0]
    assert "".join(o.text_delta for o in outs) + out.text_delta == "Hello\nUs"
    assert out.new_token_ids == [eos] and out.output_tokens == len(ids) + 1


def test_dropped_request_outputs_are_ignored(tok):
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(), arrival=0.0)
    proc.drop("r")
    assert proc.process([core([5, 6], 0)]).outputs == []


@pytest.mark.parametrize("shown", [False, True])
def test_known_token_texts_stream_as_the_detokenizer_does(tok, shown):
    """Requests streamed a token a step, the later ones through texts the earlier ones
    taught the processor: every delta is a fresh detokenizer's, partial characters held
    back, the first token's space stripped, specials hidden unless shown."""
    text = ("Hello 日本語 😀 mixed 👨‍👩‍👧 façade \U000e0041 <start_of_turn>user\nhi"
            "<end_of_turn>\n  spaces")
    ids = tok.encode(" " + text, add_special_tokens=False)
    shown_ids = tuple(i for i in ids if tok.is_special(i)) if shown else ()
    assert shown_ids or not shown
    proc = OutputProcessor(tok)
    for rid in ("a", "b", "c"):
        proc.add(rid, SamplingParams(shown_special_ids=shown_ids), arrival=0.0)
        detok = IncrementalDetokenizer(tok, shown=frozenset(shown_ids))
        deltas = [proc.process([dataclasses.replace(core([t], n), request_id=rid)])
                  .outputs[0].text_delta for n, t in enumerate(ids)]
        assert deltas == [detok.push(t) for t in ids], rid
    special = next(i for i in ids if tok.is_special(i))
    fallback = tok.encode("\U000e0041", add_special_tokens=False)  # one byte a token
    assert set(proc.texts.known) == set(ids)
    assert proc.texts.known[special] == "" and proc.texts.known[fallback[0]] == ""
    assert "".join(proc.texts.text(i) for i in tok.encode("Hello world", add_special_tokens=False)
                   ) == "Hello world"


# ---- on the real engine ---------------------------------------------------------------------

PROMPT = "1, 2, 3, 4, 5,"
GREEDY = {"temperature": 0, "max_tokens": 16, "logprobs": 2}


@pytest.fixture(scope="module")
def engine(default_model_path):
    return Engine.from_model(str(default_model_path), EngineConfig(kv_cache_gib=0.25))


def run_inline(e: Engine, params: SamplingParams, rid: str = "a") -> list[RequestOutput]:
    e.add_request(rid, PROMPT, params)
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return outs


def run_one_step_behind(e: Engine, params: SamplingParams) -> list[RequestOutput]:
    """The processor sees each core step's outputs only after the core ran the next step,
    as on the server's output thread; its aborts reach the core after that."""
    e.add_request("b", PROMPT, params)
    outs, pending = [], []
    while e.has_unfinished() or pending:
        current = e.core_step() if e.has_unfinished() else []
        done = e.outputs.process(pending)
        outs += done.outputs
        for request_id in done.stopped:
            e.abort(request_id)
        pending = current
    return outs


def summary(outs: list[RequestOutput]) -> list[tuple]:
    return [(o.new_token_ids, o.text_delta, o.finish_reason, o.output_tokens,
             [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs]) for o in outs]


def test_processor_a_step_behind_the_core_shows_what_step_shows(engine):
    full = "".join(o.text_delta for o in run_inline(engine, SamplingParams(**GREEDY)))
    stop = full.split()[1]  # the second word: it cuts the answer short
    params = SamplingParams(stop=(stop,), **GREEDY)
    inline = run_inline(engine, params)
    behind = run_one_step_behind(engine, params)
    assert "".join(o.text_delta for o in inline) == full[:full.index(stop)]
    assert inline[-1].finish_reason == FinishReason.STOP
    assert inline[-1].output_tokens < GREEDY["max_tokens"]
    assert summary(behind) == summary(inline)
    assert not engine.has_unfinished() and not engine.requests
    assert engine.outputs.num_live == 0


def test_many_requests_through_the_async_engine(engine, tok, monkeypatch):
    """Requests with stop strings, some sampled, some with logprobs, all at once: each one's
    text is its tokens' text cut at its first stop, and its counts end there too; the ones a
    stop string ended are aborted in the engine."""
    aborted: list[str] = []
    abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda rid: (aborted.append(rid), abort(rid)))
    prompts = ["Once upon a time", "The capital of France is", "List three fruits:",
               "def add(a, b):", PROMPT, "Q: What is 2+2?\nA:"]
    stops = [(",",), (".",), ("\n",), (" the", "."), ("3",), ("e",)]
    requests = [EngineRequest(
        f"r{i}", tok.encode(prompts[i % len(prompts)]),
        SamplingParams(max_tokens=12, temperature=0 if i % 2 else 0.8, seed=i,
                       stop=stops[i % len(stops)], include_stop_str_in_output=i % 3 == 0,
                       logprobs=1 if i % 4 == 0 else None)) for i in range(24)]

    async def one(ae: AsyncEngine, req: EngineRequest) -> list[RequestOutput]:
        return [out async for out in await ae.add([req])]

    async def main() -> tuple[list[list[RequestOutput]], bool]:
        ae = AsyncEngine(engine, max_waiting=32)
        await ae.start()
        try:
            threads = {t.name for t in threading.enumerate()}
            results = await asyncio.gather(*(one(ae, r) for r in requests))
            for _ in range(200):  # the aborts at stop strings reach the engine thread
                if not engine.requests:
                    break
                await asyncio.sleep(0.01)
            return results, "kvlab-outputs" in threads
        finally:
            await ae.stop()

    results, output_thread = asyncio.run(asyncio.wait_for(main(), timeout=600))
    assert output_thread
    for req, outs in zip(requests, results):
        check_cut_at_stop(tok, req, outs)
        final = outs[-1]
        by_string = final.finish_reason == FinishReason.STOP and final.new_token_ids[-1] \
            not in tok.eos_ids and final.output_tokens < req.params.max_tokens
        assert (req.request_id in aborted) == by_string
    assert not engine.requests and engine.outputs.num_live == 0


def check_cut_at_stop(tok, req: EngineRequest, outs: list[RequestOutput]) -> None:
    ids = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.text_delta for o in outs)
    final = outs[-1]
    assert final.finished and sum(o.finished for o in outs) == 1
    assert final.output_tokens == len(ids)
    if req.params.logprobs is not None:
        assert [lp.token_id for o in outs for lp in o.logprobs] == ids
    whole = tok.decode(ids)
    hits = [whole.find(s) for s in req.params.stop if s in whole]
    if not hits:  # no stop string: a token ended it
        assert text == whole and final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        return
    at = min(hits)
    stop = next(s for s in req.params.stop if whole.find(s) == at)
    assert final.finish_reason == FinishReason.STOP
    assert text == whole[:at + (len(stop) if req.params.include_stop_str_in_output else 0)]
    assert at + len(stop) > len(tok.decode(ids[:-1]))  # its last token completed the stop


def test_a_failure_making_text_fails_the_requests_in_flight(engine, tok, monkeypatch):
    """The output thread's failure reaches the callers as a failed step does, and their
    requests are aborted in the engine; the next call is served."""
    def fail(core_outputs):
        raise ValueError("boom")

    params = SamplingParams(max_tokens=8, temperature=0)

    async def main() -> tuple[BaseException | None, list[RequestOutput]]:
        ae = AsyncEngine(engine, max_waiting=4)
        await ae.start()
        try:
            with monkeypatch.context() as m:
                m.setattr(engine.outputs, "process", fail)
                gen = await ae.add([EngineRequest("f", tok.encode(PROMPT), params)])
                try:
                    async for _ in gen:
                        pass
                    error = None
                except EngineStepError as e:
                    error = e
            for _ in range(200):  # the abort reaches the engine thread between steps
                if not engine.requests:
                    break
                await asyncio.sleep(0.01)
            gen = await ae.add([EngineRequest("g", tok.encode(PROMPT), params)])
            return error, [out async for out in gen]
        finally:
            await ae.stop()

    error, outs = asyncio.run(asyncio.wait_for(main(), timeout=300))
    assert isinstance(error, EngineStepError) and "boom" in str(error)
    assert outs[-1].finished and outs[-1].output_tokens == len(
        [t for o in outs for t in o.new_token_ids])
    assert not engine.requests and engine.outputs.num_live == 0
