"""The batched step model (kvlab.estimate.step_model), its factors fitted to timed steps, and the
scheduler simulation over it (kvlab.estimate.serving_replay): hand-made models and step times, no
timing."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from test_estimate_kernel_steps import NS, US, machine, model

from kvlab.cli import loadtest_estimate as le
from kvlab.cli.estimate import _check_kvlab_kv
from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, Workload
from kvlab.estimate import serving_check as sc
from kvlab.estimate.hardware import StepFactors, StreamCosts
from kvlab.estimate.kernel_steps import StepCosts
from kvlab.estimate.serving_replay import RequestSpec, percentile, predict_serving, simulate
from kvlab.estimate.specs import spec_from_gguf
from kvlab.estimate.step_model import (
    SeqWork,
    StepModel,
    TimedStep,
    factors_from_dict,
    fit_factors,
    median_spread,
    predict,
)
from kvlab.harness.loadtest import LoadConfig, RequestResult, summarize
from kvlab.kernels import kernel_backend
from kvlab.probe import resolve_hardware
from kvlab.probe.cache import ProbeResult, save_probe
from kvlab.probe.engine_overhead import SyntheticShape, write_synthetic_gguf
from kvlab.probe.steps import _paired, measure_steps, write_replica
from kvlab.probe.stream_costs import fit_stream_costs
from kvlab.scheduler import SchedulerConfig
from kvlab.server.viz.predict import predict as viz_predict
from kvlab.weights.gguf_file import GGUFFile

FACTORS = StepFactors(fixed=1.5, kv={"f32": 2.0, "f16": 3.0}, batch=0.5, prefill=1.25,
                      prefill_attention=2.5, model="hand")


# -- the batched step ------------------------------------------------------------------------


def test_one_decode_is_kernel_steps_decode() -> None:
    sm, costs = StepModel(model(), machine()), StepCosts(model(), machine().kernels)
    assert sm.decode_seconds([99]) == pytest.approx(costs.decode(100).total, rel=1e-12)


def test_batched_decode_reads_weights_once() -> None:
    sm = StepModel(model(), machine())
    one, four = sm.terms([SeqWork(1, 99)]), sm.terms([SeqWork(1, 99)] * 4)
    assert four.fixed == one.fixed  # one pass over the weights, one step's glue
    assert four.kv == pytest.approx(4 * one.kv)
    # each further row: 2 x params of every block matrix at its prefill rate, its
    # element-wise passes; each further sample: the output product and 1000 logits
    row = 2 * (2 * (64 * 64 * 2 / 100e9 + 16 * 64 * 2 / 100e9 + 128 * 64 * 2 / 200e9
                    + 64 * 128 / 100e9)) + 2 * (4 * 64 * NS + 5 * 16 * NS + 128 * NS)
    logit = 2 * 1000 * 64 / 100e9 + 1000 * NS
    assert sm.row == pytest.approx(row)
    assert four.batch == pytest.approx(3 * (row + logit))
    assert four.prefill == four.attention == 0


def test_prefill_chunk_and_mixed_step() -> None:
    sm = StepModel(model(), machine())
    out = sm.costs.read_seconds(sm.costs.output) + 5 * US
    first = sm.terms([SeqWork(512, 0, logits=False)])
    last = sm.terms([SeqWork(512, 0, logits=True)])
    assert last.fixed - first.fixed == pytest.approx(out)  # no sample: no output product
    assert first.prefill == pytest.approx(512 * sm.row) and first.batch == 0
    # 2 layers x 2 x 4 heads x 32 FLOP a (query, key) pair, 512 x 512 pairs, 100 GFLOP/s
    assert first.attention == pytest.approx(2 * 256 * 512 * 512 / 100e9)
    mixed = sm.terms([SeqWork(1, 40), SeqWork(1, 60), SeqWork(100, 0)])
    assert mixed.batch == pytest.approx(2 * sm.row + 2 * sm.logit)  # both decodes are extra
    assert mixed.prefill == pytest.approx(100 * sm.row)


def test_chunk_attention_keys_start_at_the_first_visible() -> None:
    from test_estimate_kernel_steps import layer

    sm = StepModel(model(layers=(layer(window=4),)), machine())
    # start 5, tokens 3, window 4: keys 2..7, six of them, for each of the three queries
    assert sm.chunk_attention_flop(SeqWork(3, 5)) == 256 * 3 * 6
    assert sm.chunk_attention_flop(SeqWork(3, 0)) == 256 * 3 * 3


def test_kv_dtypes_scale_the_bytes() -> None:
    kv = {d: StepModel(model(), machine(), d).kv_seconds(100) for d in ("f32", "f16", "q8_0")}
    assert kv["f16"] == pytest.approx(kv["f32"] / 2)
    assert kv["q8_0"] == pytest.approx(kv["f32"] * 34 / 32 / 4)


def test_factors_scale_their_groups() -> None:
    work = [SeqWork(1, 300), SeqWork(1, 10), SeqWork(64, 20)]
    plain = StepModel(model(), machine()).terms(work)
    hw = replace(machine(), steps=FACTORS)
    scaled = StepModel(model(), hw, "f16").seconds(work)
    assert scaled == pytest.approx(1.5 * plain.fixed + 0.5 * plain.batch + 1.25 * plain.prefill
                                   + 3.0 * plain.kv / 2 + 2.5 * plain.attention)
    assert FACTORS.kv_factor("q8_0") == 2.0  # not timed: f32's


def test_prompt_in_chunks() -> None:
    sm = StepModel(model(), machine())
    assert sm.prompt_seconds(1200, 512) == pytest.approx(
        sm.prefill_seconds(512, 0, False) + sm.prefill_seconds(512, 512, False)
        + sm.prefill_seconds(176, 1024, True))


# -- the factors fitted to timed steps -------------------------------------------------------


def _timed(hw_steps: StepFactors) -> list[TimedStep]:
    """Step shapes as the probe times them, at the seconds `hw_steps` gives them."""
    shapes = {"prefill 512": (SeqWork(512, 0, False),), "prefill 512 at 512": (SeqWork(512, 512),),
              "prefill 32": (SeqWork(32, 0),), "decode 1 at 32": (SeqWork(1, 36),),
              "decode 1 at 1024": (SeqWork(1, 4000),),
              "decode 4 at 32": (SeqWork(1, 36),) * 4, "decode 16 at 32": (SeqWork(1, 36),) * 16}
    sm = StepModel(model(), replace(machine(), steps=hw_steps))
    timed = [TimedStep(n, w, sm.seconds(w), 0.01) for n, w in shapes.items()]
    f16 = StepModel(model(), replace(machine(), steps=hw_steps), "f16")
    busier = 0.003  # the f16 engine ran in a busier moment: its level moves, not its slope
    return timed + [TimedStep(f"decode 1 at {c} f16", (SeqWork(1, c),),
                              f16.seconds((SeqWork(1, c),)) + busier, 0.02, "f16")
                    for c in (36, 4000)]


def test_fit_recovers_the_factors_of_exact_steps() -> None:
    f = fit_factors(model(), machine(), _timed(FACTORS), name="hand")
    assert f.fixed == pytest.approx(1.5) and f.kv["f32"] == pytest.approx(2.0)
    assert f.batch == pytest.approx(0.5) and f.prefill == pytest.approx(1.25)
    assert f.prefill_attention == pytest.approx(2.5) and f.kv["f16"] == pytest.approx(3.0)
    assert f.noise == 0.02 and f.model == "hand"
    busier = {p["name"]: p["seconds"] - p["fitted"] for p in f.points}
    assert all(busier[n] == pytest.approx(0.003 if "f16" in n else 0, abs=1e-12) for n in busier)
    assert factors_from_dict(json.loads(json.dumps(asdict(f)))) == f  # the probe cache


def test_fit_clamps_noise_and_keeps_one_without_data() -> None:
    f = fit_factors(model(), machine(), [])
    assert (f.fixed, f.batch, f.prefill, f.prefill_attention, f.kv) == (1, 1, 1, 1, {"f32": 1})
    wild = [replace(t, seconds=t.seconds * 100) for t in _timed(FACTORS)]
    f = fit_factors(model(), machine(), wild)
    assert all(0.25 <= x <= 16 for x in (f.fixed, f.batch, f.prefill, *f.kv.values()))


DEPTHS = replace(FACTORS, kv={"f32": 2.0}, kv_depths={"f32": ((1000.0, 2.0), (4000.0, 6.0))},
                 batch_sizes=((2.0, 0.5), (4.0, 1.0), (16.0, 1.0)),
                 prefill_sizes=((32.0, 2.0), (512.0, 1.25)))


def test_kv_by_depth_and_batch_by_size() -> None:
    sm = StepModel(model(), replace(machine(), steps=DEPTHS))
    # positions 1..1000 at 2x the kernel rate, 1001.. at 6x: 3000 further at 6x
    assert sm.depth_kv_seconds(4000, DEPTHS.kv_depths["f32"]) == pytest.approx(
        2 * sm.kv_seconds(1000) + 6 * (sm.kv_seconds(4000) - sm.kv_seconds(1000)))
    assert sm.depth_kv_seconds(500, DEPTHS.kv_depths["f32"]) == pytest.approx(
        2 * sm.kv_seconds(500))
    assert sm.depth_kv_seconds(8000, DEPTHS.kv_depths["f32"]) == pytest.approx(
        2 * sm.kv_seconds(1000) + 6 * (sm.kv_seconds(8000) - sm.kv_seconds(1000)))
    three = [SeqWork(1, 35)] * 3
    plain = StepModel(model(), machine()).terms(three)
    assert sm.scaled_terms(three).batch == pytest.approx(0.75 * plain.batch)  # 2..4 halfway
    assert DEPTHS.batch_factor(1) == 0.5 and DEPTHS.batch_factor(32) == 1.0  # held at ends
    # 128 rows: halfway from 32 to 512 in log(rows)
    assert sm.scaled_terms([SeqWork(128, 0)]).prefill == pytest.approx(128 * sm.row * 1.625)


def test_fit_recovers_depths_and_batch_sizes() -> None:
    shapes = {"prefill 512": (SeqWork(512, 0, False),), "prefill 32": (SeqWork(32, 0),),
              "prefill 512 at 512": (SeqWork(512, 512),)}
    shapes.update({f"decode 1 at {c}": (SeqWork(1, c - 1),) for c in (36, 1000, 4000)})
    shapes.update({f"decode {n} at 32": (SeqWork(1, 35),) * n for n in (2, 4, 16)})
    sm = StepModel(model(), replace(machine(), steps=DEPTHS))
    timed = [TimedStep(n, w, sm.seconds(w), 0.01) for n, w in shapes.items()]
    f = fit_factors(model(), machine(), timed)
    flat = [x for pair in f.kv_depths["f32"] for x in pair]
    assert flat == pytest.approx([1000.0, 2.0, 4000.0, 6.0])
    assert f.fixed == pytest.approx(1.5) and f.kv["f32"] == pytest.approx(2.0)
    assert [x for pair in f.batch_sizes for x in pair] == pytest.approx(
        [2.0, 0.5, 4.0, 1.0, 16.0, 1.0])
    assert f.prefill == pytest.approx(1.25) and f.prefill_attention == pytest.approx(2.5)
    assert [x for pair in f.prefill_sizes for x in pair] == pytest.approx([32, 2.0, 512, 1.25])
    assert all(p["fitted"] == pytest.approx(p["seconds"]) for p in f.points)
    assert factors_from_dict(json.loads(json.dumps(asdict(f)))) == f


def test_median_spread() -> None:
    assert median_spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, pytest.approx(2 / 3))


def test_predict_uses_the_timed_steps() -> None:
    hw = replace(machine(), steps=FACTORS)
    wl = Workload(prompt_tokens=600, output_tokens=3, kv_dtype="f32")
    p, sm = predict(model(), hw, wl), StepModel(model(), hw)
    assert p.ttft == pytest.approx(sm.prompt_seconds(600, 512))
    assert p.decode_first.total == pytest.approx(sm.decode_seconds([600]))
    assert p.decode_last.total == pytest.approx(sm.decode_seconds([601]))
    assert p.steps_from == "hand" and "replica of hand" in p.format()


# -- the scheduler simulation ----------------------------------------------------------------


class Steps:
    """10 ms a step plus 1 ms a row; remembers every step's work."""

    def __init__(self) -> None:
        self.seen: list[list[SeqWork]] = []

    def __call__(self, work: list[SeqWork]) -> float:
        self.seen.append(list(work))
        return 0.010 + 0.001 * sum(w.tokens for w in work)


def test_one_request_alone() -> None:
    steps = Steps()
    p = simulate([RequestSpec(40, 4)], steps, concurrency=1)
    (t,) = p.traces
    assert t.ttft == pytest.approx(0.050) and t.itl == pytest.approx([0.011] * 3)
    assert [len(s) for s in steps.seen] == [1, 1, 1, 1] and p.steps == 4
    assert steps.seen[1] == [SeqWork(1, 40, True)]  # the sampled token is the next row
    assert p.output_tok_s == pytest.approx(4 / 0.083)


def test_long_prompt_is_chunked_under_the_budget() -> None:
    steps = Steps()
    simulate([RequestSpec(1200, 2)], steps, 1, SchedulerConfig(16, 512))
    assert [w for (w,) in steps.seen[:3]] == [SeqWork(512, 0, False), SeqWork(512, 512, False),
                                              SeqWork(176, 1024, True)]


def test_closed_loop_sends_the_next_request_when_one_ends() -> None:
    p = simulate([RequestSpec(10, 3)] * 4, Steps(), concurrency=2)
    first, second, third, fourth = p.traces
    assert first.sent == second.sent == 0
    assert third.sent == pytest.approx(first.finished) and fourth.sent == third.sent


def test_decodes_and_a_new_prompt_share_a_step() -> None:
    steps = Steps()
    simulate([RequestSpec(10, 5), RequestSpec(30, 2, arrival=0.025)], steps, concurrency=2)
    # step 1 prefills the first (20 ms); at 20 ms the second has not arrived; step 2
    # decodes (31 ms); the second arrived meanwhile and joins step 3 beside the decode
    assert steps.seen[2] == [SeqWork(1, 11, True), SeqWork(30, 0, True)]


def test_max_num_seqs_holds_sequences_back() -> None:
    steps = Steps()
    p = simulate([RequestSpec(10, 3)] * 4, steps, 4, SchedulerConfig(2, 512))
    assert max(len(s) for s in steps.seen) == 2
    assert sorted(t.ttft for t in p.traces)[2] > p.traces[0].finished - 1e-9


def test_open_loop_waits_for_arrivals() -> None:
    p = simulate([RequestSpec(10, 2, arrival=0.0), RequestSpec(10, 2, arrival=5.0)], Steps(), 8)
    assert p.traces[1].sent == 5.0 and p.traces[1].ttft == pytest.approx(0.020)


def test_intake_delays_the_first_step() -> None:
    steps = Steps()
    p = simulate([RequestSpec(10, 2)] * 2, steps, concurrency=1, request_seconds=0.005)
    first, second = p.traces
    assert first.ttft == pytest.approx(0.005 + 0.020)  # intake, then the prefill step
    assert second.sent == pytest.approx(first.finished)
    assert second.ttft == pytest.approx(0.005 + 0.020)


def test_intake_takes_requests_one_at_a_time() -> None:
    """Four clients sending at once: the first is prefilled alone by the idle engine, the
    other three arrive during that step and are prefilled together in the next."""
    steps = Steps()
    p = simulate([RequestSpec(10, 2)] * 4, steps, concurrency=4, request_seconds=0.001,
                 intake_seconds=0.001)
    assert [len(s) for s in steps.seen[:2]] == [1, 4]  # then B, C, D and A's first decode
    first, *rest = p.traces
    # A in at 1 ms; its 20 ms step shares the cores with B's, C's and D's intake (3 ms)
    assert first.ttft == pytest.approx(0.001 + 0.020 + 0.003)
    # the second step: three 10-token prefills and A's decode, 10 ms + 31 x 1 ms
    assert [t.ttft for t in rest] == pytest.approx([0.024 + 0.041] * 3)


def test_stream_costs_fitted_and_added() -> None:
    hw = replace(machine(), steps=FACTORS)
    specs = {c: [RequestSpec(20, 16)] * 2 * c for c in (1, 8)}
    bare = {c: predict_serving(model(), hw, specs[c], c) for c in specs}
    cost = StreamCosts(token=0.0005, step=0.002, request=0.010, serial=0.5)
    timed = {c: predict_serving(model(), replace(hw, stream=cost), specs[c], c) for c in specs}
    runs = {c: {"completed": 2 * c, "total_input_tokens": 40 * c, "total_output_tokens": 32 * c,
                "output_throughput": timed[c].output_tok_s,
                "itl_ms": {"p50": 1e3 * timed[c].itl(0.5)},
                "ttft_ms": {"p50": 1e3 * timed[c].ttft(0.5)}} for c in specs}
    fitted = fit_stream_costs(model(), hw, "f32", runs)
    assert fitted.serial == 0.5  # half the request cost one request at a time
    assert fitted.token == pytest.approx(0.0005, rel=1e-3)
    assert fitted.step == pytest.approx(0.002, rel=1e-3)
    assert fitted.request == pytest.approx(0.010, rel=1e-3)
    # without the intake's stagger, a step of 8 streams is the bare one plus the step's and
    # the tokens' costs
    steps_only = predict_serving(model(), replace(hw, stream=replace(cost, request=0.0)),
                                 specs[8], 8)
    assert steps_only.itl(0.5) == pytest.approx(bare[8].itl(0.5) + 0.002 + 8 * 0.0005)
    assert cost.step_seconds(0) == 0.0  # a step that streams nothing (a prefill chunk)


def test_percentiles_and_bad_input() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and percentile([], 0.5) == 0.0
    with pytest.raises(ValueError, match="concurrency"):
        simulate([RequestSpec(1, 1)], Steps(), 0)


def test_more_users_more_throughput_slower_streams() -> None:
    hw = replace(machine(), steps=FACTORS)
    one = predict_serving(model(), hw, [RequestSpec(40, 32)] * 4, 1)
    four = predict_serving(model(), hw, [RequestSpec(40, 32)] * 4, 4)
    assert four.output_tok_s > one.output_tok_s and four.itl(0.5) > one.itl(0.5)


# -- the commands ----------------------------------------------------------------------------


def _probe_with_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from test_estimate_kernel_steps import rates


    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    save_probe(ProbeResult(bandwidth_gbs=20.0, tflops={"fp32": 0.5}, memory_gib=16.0,
                           threads=2, cpu="Test CPU", measured_at="2025-01-02T03:04:05+00:00",
                           kernels=asdict(rates()), steps=asdict(FACTORS)))
    gguf = tmp_path / "tiny.gguf"
    write_synthetic_gguf(gguf, "gemma3", 2, SyntheticShape(64, 128, 4, 1, 32, 16))
    return gguf


def test_estimate_engine_kvlab_concurrency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from test_estimate_cli import run_cli


    gguf = _probe_with_steps(tmp_path, monkeypatch)
    assert run_cli(["estimate", str(gguf), "--engine", "kvlab", "--concurrency", "4",
                    "--prompt", "40", "--output", "16", "--kv-dtype", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "16 requests from 4 closed-loop clients" in out and "TTFT p50" in out
    assert "q8_0 KV cache" in out
    assert run_cli(["estimate", str(gguf), "--engine", "kvlab", "--concurrency", "2",
                    "--json"]) == 0
    serving = json.loads(capsys.readouterr().out)["kvlab"]["serving"]
    assert serving["concurrency"] == 2 and serving["output_tok_s"] > 0
    with pytest.raises(KvlabError, match="no bf8"):
        _check_kvlab_kv("bf8", replace(machine(), steps=FACTORS))


def test_loadtest_estimate_replays_the_run(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _probe_with_steps(tmp_path, monkeypatch)
    args = argparse.Namespace(estimate_model=str(gguf), server_max_num_seqs=16,
                              server_max_num_batched_tokens=512, server_kv_dtype="f32")
    p = le.predictor(args)
    cfg = LoadConfig(url="http://x", concurrency=2, num_requests=3)
    results = [RequestResult(ok=True, prompt_tokens=30, output_tokens=8, ttft=0.1,
                             latency=0.5, itl=[0.05] * 7) for _ in range(3)]
    results.append(RequestResult(ok=False, error="boom"))
    pred = p.level(cfg, results)
    assert len(pred.traces) == 3 and pred.concurrency == 2
    text = sc.format_check(p, [(2, pred, summarize(cfg, "m", results, 1.0, {}))])
    assert "output tok/s" in text and "replica of hand" in text and "%" in text
    assert sc._arrivals(LoadConfig(url="x", rate=2.0, seed=0), 3)[0] == 0.0
    (gap,) = sc._gap_notes([(1, {"itl_p50_ms": 12.0}, {"itl_p50_ms": 19.5})])
    assert "each token took +7.5 ms beside the predicted engine step" in gap
    with pytest.raises(Exception, match="server-kv-dtype"):
        le.predictor(argparse.Namespace(**{**vars(args), "server_kv_dtype": "f8"}))


def test_visualiser_predicts_kvlab_for_several_users(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _probe_with_steps(tmp_path, monkeypatch)
    spec, hw = spec_from_gguf(gguf), resolve_hardware("this")
    one = viz_predict(spec, hw, 40, 16, concurrency=1, kv_dtype="f32")
    four = viz_predict(spec, hw, 40, 16, concurrency=4, kv_dtype="f32")
    assert one["engine"] == four["engine"] == "kvlab"
    assert four["ttft_s"] > one["ttft_s"] and four["decode_tok_s"] < one["decode_tok_s"]
    gpu = viz_predict(spec, HardwareSpec.from_name("rtx-4090"), 40, 16, 4)
    assert gpu["engine"] == "roofline"


# -- the step probe on a tiny model ----------------------------------------------------------


def test_replica_keeps_the_layout_and_the_probe_times_every_shape(tmp_path: Path) -> None:
    from test_probe import TINY


    if kernel_backend() == "torch":
        pytest.skip("kvlab's C kernels are not built")
    source, replica = tmp_path / "m.gguf", tmp_path / "r.gguf"
    write_synthetic_gguf(source, "gemma3", 2, TINY)
    write_replica(source, replica)
    a, b = GGUFFile(source), GGUFFile(replica)
    assert a.metadata == b.metadata and a.tensors == b.tensors
    assert (b.raw("output_norm.weight") == a.raw("output_norm.weight")).all()  # copied
    spec = spec_from_gguf(replica)
    assert spec == replace(spec_from_gguf(source), name=spec.name)
    f = measure_steps(source, spec, machine(), threads=1, rounds=1, other_kv=("q8_0",),
                      window_s=0.0)
    names = {p["name"] for p in f.points}
    assert {"prefill 512", "prefill 512 at 512", "decode 16 at 32", "decode 2 at 32",
            "decode 1 at 4080", "decode 1 at 1024 q8_0"} <= names  # 4080: the tiny context
    assert set(f.kv) == {"f16", "q8_0"} and f.model == spec.name  # f16: the engine's own
    assert [n for n, _ in f.batch_sizes] == [2, 4, 8, 16] and len(f.kv_depths["f16"]) == 2
    assert f.rounds == 1  # no window: the rounds asked for


def test_decodes_paired_with_their_rounds_reference() -> None:
    samples = {"decode 1 at 32": [10.0, 20.0, 10.0], "decode 1 at 4096": [14.0, 27.0, 14.0],
               "prefill 32": [50.0, 90.0, 50.0]}
    paired = _paired(samples, "decode 1 at 32")
    assert paired["decode 1 at 4096"] == pytest.approx([14.0, 13.5, 14.0])
    assert paired["decode 1 at 32"] == samples["decode 1 at 32"]
    assert paired["prefill 32"] == samples["prefill 32"]  # prefill: its own level
