"""The one-call C decode's time split per layer kind (kvlab.kernels.decode_profile) on tiny
random hybrids (LFM2's short convolution, Qwen3.5's Gated DeltaNet, Granite 4 hybrid's
Mamba-2, each beside attention layers): every kind the model has gets time, the kinds sum to
no more than the calls' wall time measured around them, only the one-call decode steps are
counted, and the logits are the same with the profile on as off."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from test_hybrid_decode_c import _engine, _ids, _runner, _seq, _step

from kvlab.harness.decode_split import profiled_tg
from kvlab.harness.llama_bench import bench_tg
from kvlab.kernels import decode_profile, fused
from kvlab.models import decode_c

from tiny_models import build_hybrid

pytestmark = pytest.mark.skipif(not fused.ENABLED, reason="needs kvlab's C extension")

DECODES = 6


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5", "granitehybrid"])
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"profile_{request.param}")
    build_hybrid(request.param, out)
    return out


@pytest.fixture
def profile():
    """The profile off and zeroed before and after the test (it is the process's)."""
    decode_profile.enable(False)
    decode_profile.reset()
    yield decode_profile
    decode_profile.enable(False)
    decode_profile.reset()


@pytest.fixture
def c_call_ns(monkeypatch) -> list[int]:
    """The wall time of each decode_c.run call that ran the step in C, measured around it."""
    spent, run = [], decode_c.run

    def timed(*args, **kw):
        start = time.perf_counter_ns()
        ran = run(*args, **kw)
        if ran:
            spent.append(time.perf_counter_ns() - start)
        return ran

    monkeypatch.setattr(decode_c, "run", timed)
    return spent


def _decode(out, on: bool) -> torch.Tensor:
    """A 5-token prefill (per op) then DECODES one-token steps, the profile on or off."""
    runner = _runner(out, "q8_0", True)
    ids, table = _ids(5 + DECODES, 4), [6, 2, 9]
    rows = [_step(runner, _seq("a", 0, ids[:5], table, 1))[0]]
    decode_profile.enable(on)
    rows += [_step(runner, _seq("a", pos, [ids[pos]], table, 1))[0]
             for pos in range(5, len(ids))]
    decode_profile.enable(False)
    return torch.stack(rows)


def test_each_kind_the_model_has_gets_time_within_the_calls(tiny, profile, c_call_ns):
    _decode(tiny, True)
    got = profile.read()
    assert got.calls == len(c_call_ns) == DECODES  # the per-op prefill is not counted
    assert all(s >= 0 for s in got.seconds.values())
    for kind in ("attention", "recurrent", "mlp"):
        assert got.seconds[kind] > 0, kind
    assert sum(got.seconds.values()) <= got.call_seconds <= sum(c_call_ns) / 1e9
    per_call = got.per_call_ms()
    assert per_call["recurrent"] == pytest.approx(1e3 * got.seconds["recurrent"] / DECODES)


def test_the_logits_are_the_same_with_the_profile_on(tiny, profile):
    off = _decode(tiny, False)
    assert profile.read().calls == 0  # off: nothing counted
    on = _decode(tiny, True)
    assert profile.read().calls == DECODES
    assert torch.equal(on, off)


def test_reset_and_since(tiny, profile):
    _decode(tiny, True)
    first = profile.read()
    _decode(tiny, True)
    both = profile.read()
    assert both.since(first).calls == DECODES
    assert both.since(first).seconds["attention"] == pytest.approx(
        both.seconds["attention"] - first.seconds["attention"])
    profile.reset()
    cleared = profile.read()
    assert cleared.calls == 0 and cleared.call_seconds == 0
    assert set(cleared.seconds.values()) == {0.0}


def test_a_tg_test_split_by_layer_kind(tiny, profile):
    """kvlab bench --profile-layers' tg test on the engine: one profiled C call per decode
    step after the per-op prefill, each kind's ms per token, the rest of the step
    head/other; the profile is off afterwards. A model without the C plan has no split."""
    engines = [_engine(tiny, "q8_0", True), _engine(tiny, "q8_0", True),
               _engine(tiny, "q8_0", False)]
    try:
        result, split = profiled_tg(engines[0], 5, 2, depth=6)
        assert split is not None and split.test == result.test == "tg5@d6"
        assert split.steps == 2 * 5
        # each sample is 5 / (its repetition's seconds): a token's ms is 1000 / sample's mean
        assert split.step_ms == pytest.approx(
            1e3 * statistics.fmean(1 / s for s in result.samples))
        assert all(split.ms[k] > 0 for k in ("attention", "recurrent", "mlp"))
        assert split.ms["head/other"] > 0  # the head and sampling are outside the layers
        assert profile.read().calls == split.steps
        bench_tg(engines[1], 3, 1, depth=6)
        assert profile.read().calls == split.steps  # off after the test
        assert profiled_tg(engines[2], 3, 1, depth=6)[1] is None
    finally:
        for e in engines:
            e.close()
