"""Hybrid models (tiny random LFM2, weights quantized at load) decode in the one C call: the
short-convolution layers' in-projection, C short conv on each sequence's state row and
out-projection beside the QK-norm attention layers and SwiGLU MLPs. Every product and the
conv are the per-op path's own C calls in the same order, so the logits are equal bit for bit:
alone, batched at unequal depths, through the engine with preemption, and after a prefix
hit that restores a state snapshot. A step of several tokens of one sequence (a speculative
verify) and recurrent kinds without plan fields (Qwen3.5's Gated DeltaNet) stay per op."""

from __future__ import annotations

import pytest
import torch
from test_hybrid import byte_tokenizer_metadata

from kvlab.engine import Engine, EngineConfig
from kvlab.kernels import fused
from kvlab.models import decode_c
from kvlab.models.loader import LoadOptions, load_model
from kvlab.models.state_store import StateBatch
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_hybrid

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

# name -> (build_hybrid overrides, quantization at load); 256 wide for Q4_K's blocks
VARIANTS = {"q8_0": ({}, "q8_0"), "q4_k": ({"hidden_size": 256}, "q4_k")}
# a plan row's recurrent fields, just before Gemma 4's and the latent-attention ones: mixer,
# rc_in (5), rc_out (5), conv, conv_k
MIXER_FIELDS = slice(-24 - decode_c._MLA_FIELDS - decode_c._MIXER_FIELDS,
                     -24 - decode_c._MLA_FIELDS)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    overrides, quant = VARIANTS[request.param]
    out = tmp_path_factory.mktemp(f"lfm2_c_{request.param}")
    build_hybrid("lfm2", out, **overrides)
    return out, quant


@pytest.fixture
def c_steps(monkeypatch) -> list[bool]:
    """What each decode_c.run call returns (True: the one C call ran the step)."""
    ran, run = [], decode_c.run
    monkeypatch.setattr(decode_c, "run",
                        lambda *args, **kw: ran.append(run(*args, **kw)) or ran[-1])
    return ran


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _loaded(out, quant: str, plan: bool):
    loaded = load_model(open_checkpoint(out / "hf"), LoadOptions(quantize=quant))
    assert loaded.model.c_plan is not None
    if not plan:
        loaded.model.c_plan = None
    return loaded


def _runner(out, quant: str, plan: bool) -> ModelRunner:
    loaded = _loaded(out, quant, plan)
    return ModelRunner(loaded.model, loaded.config, 64, 4, kv_dtype="f32", num_state_slots=4)


def _step(runner: ModelRunner, *seqs: ScheduledSeq) -> torch.Tensor:
    return runner.execute(SchedulerOutput(list(seqs))).logits


def _seq(name: str, start: int, ids: list[int], table: list[int], slot: int) -> ScheduledSeq:
    return ScheduledSeq(name, start, ids, table, True, len(ids) if start == 0 else 0,
                        state_slot=slot)


def test_the_plan_takes_the_convolution_layers(tiny):
    """Convolution layers read no K/V; their row holds the in- and out-projections, the conv
    weight and its width; attention layers have no mixer fields."""
    out, quant = tiny
    model = _runner(out, quant, True).model
    config = model.config
    assert model.c_plan.sources == [None if config.is_recurrent(i) else i
                                    for i in range(config.num_layers)]
    for i, (row, layer) in enumerate(zip(model.c_plan.weights.tolist(), model.layers)):
        fields = row[MIXER_FIELDS]
        if not config.is_recurrent(i):
            assert fields == [0] * decode_c._MIXER_FIELDS
            continue
        assert fields[0] == decode_c.MIX_SHORT_CONV
        assert fields[1:6] == list(layer["conv_in"].kernel_args)
        assert fields[6:11] == list(layer["conv_out"].kernel_args)
        assert fields[11:] == [layer["conv"].data_ptr(), config.recurrent.conv_kernel]


def test_decode_in_the_one_c_call_equals_the_per_op_path(tiny, c_steps):
    out, quant = tiny
    ids, table = _ids(14, 1), [9, 3, 17, 0]  # scattered, out-of-order blocks
    logits = []
    for plan in (True, False):
        runner = _runner(out, quant, plan)
        rows = [_step(runner, _seq("a", 0, ids[:5], table, 2))[0]]
        for pos in range(5, len(ids)):
            rows.append(_step(runner, _seq("a", pos, [ids[pos]], table, 2))[0])
        logits.append(torch.stack(rows))
    assert c_steps[:len(ids) - 4] == [False] + [True] * (len(ids) - 5)  # prefill per-op
    assert torch.equal(logits[0], logits[1])


def test_batched_decode_in_the_one_c_call(tiny, c_steps):
    """Three sequences of unequal lengths in scattered state slots decode together in the C
    call: each row equals the per-op path's batch."""
    out, quant = tiny
    seqs = {f"s{n}": (_ids(n, 20 + n), table, slot, _ids(3, 50 + n))
            for n, table, slot in ((3, [7, 2, 12, 19], 3), (11, [0, 15, 4, 9], 0),
                                   (6, [5, 1, 14, 11], 2))}
    fast, slow = (_decode_together(_runner(out, quant, plan), seqs) for plan in (True, False))
    assert c_steps[3:6] == [True] * 3  # after the three prefills
    assert torch.equal(fast, slow)


def _decode_together(runner: ModelRunner, seqs: dict) -> torch.Tensor:
    for name, (prompt, table, slot, _) in seqs.items():
        _step(runner, _seq(name, 0, prompt, table, slot))
    return torch.stack([_step(runner, *(
        _seq(name, len(prompt) + t, [nxt[t]], table, slot)
        for name, (prompt, table, slot, nxt) in seqs.items())) for t in range(3)])


def test_a_step_of_several_tokens_of_one_sequence_is_refused(tiny):
    """A verify step's rows (several tokens of one sequence, one state row) are not a decode
    step: the plan takes no state table for them, and the per-op path runs."""
    out, quant = tiny
    runner = _runner(out, quant, True)
    plan, states = runner.model.c_plan, runner.states
    layers = states.layers
    one = torch.tensor([1], dtype=torch.int64)
    assert plan.states(StateBatch(layers, one, one), 1) is not None
    assert plan.states(StateBatch(layers, one, torch.tensor([2])), 2) is None
    assert plan.states(StateBatch(layers, one, one), 2) is None


def _engine(out, quant: str, plan: bool, **config) -> Engine:
    tokenizer = load_gguf_tokenizer(byte_tokenizer_metadata(96))
    return Engine(_loaded(out, quant, plan), tokenizer,
                  EngineConfig(**{"block_size": 4, "kv_dtype": "f32", **config}))


def _run_all(e: Engine, prompts: list[list[int]], prefix: str = "") -> list[list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(f"{prefix}{i}", p, GREEDY)
    got: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[f"{prefix}{i}"] for i in range(len(prompts))]


PROMPTS = [_ids(5, 1), _ids(25, 2), _ids(9, 3), _ids(20, 4)]


def test_engine_with_preemption_in_the_one_c_call(tiny, c_steps, monkeypatch):
    """Room for 12 blocks of 4 tokens: some requests are preempted and recomputed from
    token 0 in whichever slot is free; the greedy tokens equal the per-op engine's with
    room for all."""
    out, quant = tiny
    preempted, real = [], Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda s, seq: preempted.append(seq.seq_id)
                        or real(s, seq))
    expected = _run_all(_engine(out, quant, False), PROMPTS)
    c = _loaded(out, quant, False).config
    gib = (16 * c.state_bytes_per_seq() + 12 * 4 * c.kv_bytes_per_token(4)) / 2**30
    tight = _engine(out, quant, True, kv_cache_gib=gib)
    assert tight.kv.num_blocks == 12
    assert _run_all(tight, PROMPTS) == expected
    assert preempted and any(c_steps)


def test_a_prefix_hit_restores_a_snapshot_then_decodes_in_the_one_c_call(tiny, c_steps):
    """Snapshots every 2 blocks of 4 tokens, prefill chunks of at most 10: run again, the
    25-token prompt resumes at 24 from the restored state and decodes in the C call; its
    greedy tokens equal the per-op engine's without prefix caching."""
    out, quant = tiny
    expected = _run_all(_engine(out, quant, False, enable_prefix_caching=False), [PROMPTS[1]])
    e = _engine(out, quant, True, state_snapshot_blocks=2, max_num_batched_tokens=10)
    assert _run_all(e, [PROMPTS[1]], "first") == expected
    del c_steps[:]
    e.add_request("again", PROMPTS[1], GREEDY)
    tokens, cached = [], None
    while e.has_unfinished():
        for o in e.step():
            tokens.extend(o.new_token_ids)
            cached = o.cached_tokens
    assert (tokens, cached) == (expected[0], 24)
    # the prompt's 25th token on the restored state is a one-token step too: every step ran
    # in the C call (the last sampled token is not computed)
    assert c_steps == [True] * len(tokens)


def test_gated_delta_net_layers_are_refused(tmp_path):
    """Qwen3.5's Gated DeltaNet layers have no plan fields: no plan, per-op decode."""
    build_hybrid("qwen3_5", tmp_path)
    loaded = load_model(open_checkpoint(tmp_path / "hf"), LoadOptions(quantize="q8_0"))
    model = loaded.model
    assert decode_c.build_plan(loaded.config, model.layers, "silu") is None
    assert model.c_plan is None
