"""Async scheduling (EngineConfig.async_scheduling, kvlab.runner.inflight): a decode step is
scheduled while the one before runs and reads its input ids from that step's sampled
ids on the device. The text must be exactly what the synchronous engine makes: greedy and
seeded, alone and batched, through stops, limits, aborts, preemption, a structured request
beside plain ones, and the server's AsyncEngine; tiny random models and the default model."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvlab.cache import KVCacheManager
from kvlab.cli.common import engine_config
from kvlab.cli.main import build_parser
from kvlab.engine import Engine, EngineConfig
from kvlab.request import FinishReason, SamplingParams, Structure
from kvlab.runner import inflight
from kvlab.scheduler import Scheduler, SchedulerConfig, Sequence
from kvlab.server.core.async_engine import AsyncEngine, EngineRequest

from tiny_models import build

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 57)), [7] * 9, list(range(60, 90))]


@pytest.fixture(autouse=True, params=["worker", "inline"])
def handoff(request, monkeypatch):
    """A CPU step runs on the launcher's worker thread from CPU_OVERLAP_MIN_ROWS rows, inline
    below: every test runs each way (these batches are smaller than the default bound)."""
    monkeypatch.setattr(inflight, "CPU_OVERLAP_MIN_ROWS", 1 if request.param == "worker" else 10**9)
    return request.param


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request, tmp_path_factory):
    """gemma3: sliding-window layers with a pool of their own; llama: block tables alone."""
    out = tmp_path_factory.mktemp(request.param)
    build(request.param, out)
    return out / "model.gguf"


def engine(path, async_on: bool, **kw) -> Engine:
    return Engine.from_model(str(path), EngineConfig(
        **{"block_size": 4, "async_scheduling": async_on, **kw}))


def run(e: Engine, jobs: list[tuple[list[int], SamplingParams]], abort_at: dict | None = None
        ) -> tuple[dict[str, list[int]], dict[str, object], int]:
    """Each request's tokens and finish reason, and how many steps ended with one in
    flight. abort_at: {request id: step} aborts it before that step."""
    for i, (prompt, params) in enumerate(jobs):
        e.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    reasons: dict[str, object] = {}
    overlapped = 0
    for step in itertools.count():
        if not e.has_unfinished():
            break
        for request_id, at in (abort_at or {}).items():
            if at == step:
                e.abort(request_id)
                reasons[request_id] = "aborted"
        for out in e.step():
            assert out.request_id not in reasons, "an output after its request ended"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
                assert out.output_tokens == len(tokens[out.request_id])
        overlapped += e._inflight is not None
    assert e.kv.num_free_blocks == e.kv.num_blocks, "blocks left behind"
    return tokens, reasons, overlapped


def both(path, jobs, abort_at=None, **kw):
    results = []
    for async_on in (False, True):
        e = engine(path, async_on, **kw)
        for _, params in jobs:  # compiled before they arrive, as the server does
            if params.structured is not None:
                e.prepare_structure(params.structured)
        results.append(run(e, jobs, abort_at))
    off, on = results
    assert off[2] == 0
    return off, on


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_and_batched_as_synchronous(tiny, params):
    for jobs in ([(PROMPTS[0], params)], [(p, params) for p in PROMPTS]):
        off, on = both(tiny, jobs)
        assert on[:2] == off[:2]
        assert on[2] > 0, "no step was scheduled ahead"


def test_finishes_mid_batch_drop_the_extra_token(tiny):
    """Stop tokens, EOS-like stop ids and max_tokens end requests at different steps while
    the step after is already running for them."""
    greedy = engine(tiny, False)
    first = run(greedy, [(PROMPTS[1], GREEDY)])[0]["0"]
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                        stop_token_ids=(first[4],))),
            (PROMPTS[2], SamplingParams(max_tokens=7, temperature=0)),
            (PROMPTS[3], SEEDED)]
    off, on = both(tiny, jobs)
    assert on[:2] == off[:2]
    assert on[1]["1"] == FinishReason.STOP and on[0]["1"][-1] == first[4]
    assert on[1]["0"] == FinishReason.LENGTH and len(on[0]["0"]) == 3
    # the same ids again on one engine: a step left in flight for the ended ones is dropped
    e = engine(tiny, True)
    for _ in range(2):
        assert run(e, jobs)[:2] == off[:2]


def test_logprobs_and_penalties_beside_plain_requests(tiny):
    """Logprobs are read a step later like the ids; a penalty reads the ids it produced, so
    a step with a penalized request runs synchronously, and the others overlap once it ends."""
    def collect(e: Engine, jobs) -> tuple[list, int]:
        for i, (prompt, params) in enumerate(jobs):
            e.add_request(str(i), prompt, params)
        got, overlapped = [], 0
        while e.has_unfinished():
            got += [(o.request_id, o.new_token_ids, [(lp.token_id, round(lp.logprob, 5))
                                                     for lp in o.logprobs or []])
                    for o in e.step()]
            overlapped += e._inflight is not None
        return sorted(got, key=lambda g: g[0]), overlapped

    logprobs = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                               repetition_penalty=2.0)
    jobs = [(PROMPTS[0], logprobs), (PROMPTS[1], penalized), (PROMPTS[2], SEEDED)]
    on, overlapped = collect(engine(tiny, True), jobs)
    assert on == collect(engine(tiny, False), jobs)[0]
    assert overlapped > 0 and all(lps for request_id, _, lps in on if request_id == "0")


def test_stop_strings_as_synchronous(tiny):
    greedy = engine(tiny, False)
    text = greedy.tokenizer.decode(run(greedy, [(PROMPTS[3], GREEDY)])[0]["0"])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,))
    jobs = [(p, params if i == 3 else GREEDY) for i, p in enumerate(PROMPTS)]
    off, on = both(tiny, jobs)
    assert on[:2] == off[:2] and on[1]["3"] == FinishReason.STOP


def test_abort_mid_stream_frees_its_blocks(tiny):
    jobs = [(p, GREEDY) for p in PROMPTS]
    off, on = both(tiny, jobs, abort_at={"1": 5, "2": 8})
    assert on[:2] == off[:2]
    assert 0 < len(on[0]["1"]) < 12


def test_preemption_as_synchronous(tiny):
    # a pool of 16 blocks of 4: the four requests need 35, so some are preempted
    per_token = engine(tiny, True, kv_dtype="f32").cost.kv_bytes_per_token
    small = {"kv_dtype": "f32", "kv_cache_gib": 16 * 4 * per_token / 2**30}
    off = run(engine(tiny, False, **small), [(p, GREEDY) for p in PROMPTS])
    e = engine(tiny, True, **small)
    preempted = []
    preempt = e.scheduler._preempt
    e.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    on = run(e, [(p, GREEDY) for p in PROMPTS])
    assert on[:2] == off[:2]
    assert e.kv.num_blocks == 16 and preempted and on[2] > 0


def test_structured_request_beside_plain_ones(tiny):
    """The structured request is admitted at once (its grammar compiled before) and ends by
    its 12th token; the plain ones run on to 24, overlapped once it has ended."""
    regex = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                           structured=Structure("regex", "(ab|cd)+x"))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
    jobs = [(PROMPTS[0], greedy), (PROMPTS[1], regex), (PROMPTS[2], seeded)]
    off, on = both(tiny, jobs)
    assert on[:2] == off[:2]
    assert on[2] > 0, "the plain requests never overlapped once the structured one ended"


def test_through_the_async_engine(tiny):
    """The server's loop: core steps on the engine thread, text on the output thread."""
    async def serve(e: Engine) -> dict[str, list[int]]:
        server = AsyncEngine(e)
        await server.start()
        try:
            gen = await server.add([EngineRequest(str(i), p, GREEDY if i % 2 else SEEDED)
                                    for i, p in enumerate(PROMPTS)])
            got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
            async for out in gen:
                got[out.request_id].extend(out.new_token_ids)
            return got
        finally:
            await server.stop()

    off = asyncio.run(serve(engine(tiny, False)))
    on = asyncio.run(serve(engine(tiny, True)))
    assert on == off and all(len(t) == 12 for t in on.values())


def test_schedule_ahead_is_bookkeeping():
    """The step after a decode step: one position further each, a block only where it
    starts one, a certain finish left out, none while a waiting sequence could join."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv)
    a = Sequence("a", list(range(7)), 7, GREEDY)
    b = Sequence("b", list(range(3)), 3, SamplingParams(max_tokens=1))
    for seq in (a, b):
        sched.add(seq)
    first = sched.schedule()
    sched.update(first, {"a": a, "b": b})
    a.token_ids.append(1)
    b.token_ids.append(2)
    decode = sched.schedule()
    assert [(s.start, len(s.token_ids)) for s in decode.scheduled] == [(7, 1), (3, 1)]
    sched.update(decode, {"a": a, "b": b})
    ahead = sched.schedule_ahead(decode, max_len=100)
    assert ahead is not None
    # b reached max_tokens with the token in flight: left out; a's position 8 starts block 2
    assert [(s.seq_id, s.start) for s in ahead.scheduled] == [("a", 8)]
    assert len(ahead.scheduled[0].block_table) == 3
    sched.update_ahead(ahead, [a])
    assert a.num_computed_tokens == 9 and len(a.token_ids) == 8
    sched.finish(b)  # as the engine does once it reads b's last token
    blocks = []
    for start in range(9, 18):  # the first from any running set, then the same batch's
        a.token_ids.append(5)
        if start == 14:  # a free seat: a waiting sequence goes first, synchronously
            c = Sequence("c", [1, 2], 2, GREEDY)
            sched.add(c)
            assert sched.schedule_ahead(ahead, max_len=100) is None
            sched.finish(c)
        ahead = sched.schedule_ahead(ahead, max_len=100)
        assert [(s.seq_id, s.start) for s in ahead.scheduled] == [("a", start)]
        blocks.append(len(ahead.scheduled[0].block_table))
        assert ahead.scheduled[0].block_table == kv.block_table("a")
        sched.update_ahead(ahead, [a])
    assert blocks == [3, 3, 3, 4, 4, 4, 4, 5, 5]
    a.token_ids.append(5)  # its 19th token, the 12th of its output: nothing to schedule
    assert sched.schedule_ahead(ahead, max_len=100) is None


@pytest.mark.slow
def test_default_model_as_synchronous():
    jobs = [(p, SamplingParams(max_tokens=16, temperature=0)) for p in PROMPTS[:3]]
    jobs.append((PROMPTS[3], SamplingParams(max_tokens=16, temperature=0.8, seed=5)))
    off = run(Engine.from_model(None, EngineConfig(async_scheduling=False)), jobs)
    on = run(Engine.from_model(None, EngineConfig(async_scheduling=True)), jobs)
    assert on[:2] == off[:2] and on[2] > 0


@pytest.mark.parametrize("command", [["serve"], ["run", "hi"], ["bench"]])
def test_flag_reaches_the_engine_config(command):
    for flag, want in (([], True), (["--async-scheduling", "off"], False)):
        argv = [*command, *flag]
        assert engine_config(build_parser(argv).parse_args(argv)).async_scheduling is want


@pytest.mark.parametrize("num_blocks", [64, 8])  # 8: preemptions
def test_steady_decode_schedule_equals_the_general_pass(num_blocks):
    """schedule()'s shortcut for the same decode batch as last step gives what the general
    pass gives, through arrivals, finishes and preemptions."""
    def trace(shortcut: bool) -> list:
        kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32), kv)
        if not shortcut:
            sched._same_decode_batch = lambda: None
        seqs, steps = {}, []
        for step in range(60):
            if step % 3 == 0:  # an arrival
                seq = seqs[f"s{step}"] = Sequence(f"s{step}", [step % 7] * (3 + step % 5),
                                                   3 + step % 5, GREEDY)
                sched.add(seq)
            out = sched.schedule()
            steps.append([(s.seq_id, s.start, list(s.token_ids), list(s.block_table),
                           s.needs_logits) for s in out.scheduled] + out.preempted)
            sched.update(out, seqs)
            for s in out.scheduled:
                if s.needs_logits:
                    seqs[s.seq_id].token_ids.append(len(steps) % 11)
                    if len(seqs[s.seq_id].output_ids) >= 6 + int(s.seq_id[1:]) % 9:
                        sched.finish(seqs[s.seq_id])
        return steps

    assert trace(True) == trace(False)
