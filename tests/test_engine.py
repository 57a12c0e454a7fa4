"""The batch-first engine on a tiny random Gemma 3: batching, chunked prefill, preemption and
prefix caching never change greedy output; seeds reproduce; stops, aborts and limits behave."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.errors import RequestError
from kvlab.request import FinishReason, SamplingParams

from tiny_models import build

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3")
    hf = build("gemma3", out)
    return hf, out / "model.gguf"


def engine(path, **kw) -> Engine:
    return Engine.from_model(str(path), EngineConfig(**{"block_size": 4, **kw}))


def run_all(e: Engine, prompts, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished():
        for out in e.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))]


PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 57)), [7] * 9, list(range(60, 90))]


@pytest.fixture(scope="module")
def alone(tiny):
    return [run_all(engine(tiny[1]), [p])[0] for p in PROMPTS]


def test_greedy_equals_transformers_generate(tiny, alone):
    hf, _ = tiny
    for p, ours in zip(PROMPTS, alone):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                          min_new_tokens=10)
        assert ref[0, len(p):].tolist() == ours


def test_batched_equals_alone(tiny, alone):
    assert run_all(engine(tiny[1]), PROMPTS) == alone


def test_chunked_prefill_equals_alone(tiny, alone):
    assert run_all(engine(tiny[1], max_num_batched_tokens=6), PROMPTS) == alone


@pytest.mark.parametrize("graphs", ["off", "eager"])  # eager: the CUDA-graph decode path
def test_preemption_loses_nothing(tiny, alone, graphs):
    # room for about 60 tokens: the four requests need 121, so some are preempted
    e = engine(tiny[1], kv_cache_gib=16 * 4 * 6 * 2 * 2 * 16 * 4 / 2**30, decode_graphs=graphs,
               kv_dtype="f32")
    assert e.kv.num_blocks == 16
    got = run_all(e, PROMPTS)
    assert got == alone
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_prefix_cache_reuses_blocks_and_keeps_output(tiny, alone):
    e = engine(tiny[1])
    first = run_all(e, [PROMPTS[1]])[0]
    e.add_request("again", PROMPTS[1], GREEDY)
    outs = []
    while e.has_unfinished():
        outs.extend(e.step())
    assert [t for o in outs for t in o.new_token_ids] == first == alone[1]
    assert outs[-1].cached_tokens == (len(PROMPTS[1]) - 1) // 4 * 4


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_same_seed_same_tokens_whatever_the_batch(tiny, graphs):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234,
                            ignore_eos=True)
    a = run_all(engine(tiny[1], decode_graphs=graphs), [PROMPTS[0]], params)[0]
    b = run_all(engine(tiny[1], decode_graphs=graphs), [PROMPTS[2], PROMPTS[0], PROMPTS[3]],
                params)[1]
    assert a == b


def test_abort_frees_blocks_at_once(tiny):
    e = engine(tiny[1])
    e.add_request("x", PROMPTS[1], GREEDY)
    e.step()
    assert e.kv.num_free_blocks < e.kv.num_blocks
    e.abort("x")
    assert e.kv.num_free_blocks == e.kv.num_blocks and not e.has_unfinished()


def test_max_tokens_and_stop_token(tiny, alone):
    e = engine(tiny[1])
    stop_at = alone[0][3]
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,),
                            ignore_eos=True)
    e.add_request("s", PROMPTS[0], params)
    outs = []
    while e.has_unfinished():
        outs.extend(e.step())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == alone[0][:alone[0].index(stop_at) + 1]
    assert outs[-1].finish_reason == FinishReason.STOP
    e.add_request("l", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0,
                                                  ignore_eos=True))
    while e.has_unfinished():
        outs = e.step()
    assert outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].output_tokens == 3


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    e = engine(tiny[1])
    with pytest.raises(RequestError, match="exceeds the context length"):
        e.add_request("long", list(range(90)) * 3, GREEDY)
    with pytest.raises(RequestError, match="empty"):
        e.add_request("empty", [], GREEDY)
    assert not e.has_unfinished()


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 3.0}, {"frequency_penalty": 2.0},
                                     {"presence_penalty": 2.0}])
def test_penalties_reach_the_sampler(tiny, alone, penalty):
    # the greedy continuation of PROMPTS[0] repeats tokens; each penalty must change that
    assert len(set(alone[0])) < len(alone[0])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **penalty)
    got = run_all(engine(tiny[1]), [PROMPTS[0]], params)[0]
    assert got != alone[0]
    assert len(set(got)) > len(set(alone[0]))
