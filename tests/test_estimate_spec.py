"""Speculative decoding predicted (kvlab.estimate.speculative): the expected-tokens sum, the
speed-up at the acceptance extremes on a described model, `kvlab estimate --speculative`'s
report and refusals, and `kvlab bench --speculative ngram --estimate`'s check line."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
from test_estimate_cli import run_cli

from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, Workload, spec_from_description
from kvlab.estimate.speculative import (
    StepSeconds,
    acceptance_from_ratio,
    expected_tokens,
    predict_speculative,
    roofline_seconds,
)

DESCRIBED = ["--params", "8e9", "--bits", "4.5", "--hardware", "rtx-4090"]


def _speculative(*argv: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert run_cli(["estimate", *DESCRIBED, "--json", "--speculative", *argv]) == 0
    return json.loads(capsys.readouterr().out)["speculative"]


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(4, 0.0) == 1.0
    assert expected_tokens(4, 0.5) == pytest.approx((1 - 0.5 ** 5) / (1 - 0.5))
    assert expected_tokens(3, 0.999) == pytest.approx(4.0, rel=1e-2)


def test_acceptance_inverts_the_kept_share_of_proposals() -> None:
    a = 0.6
    share = sum(a ** i for i in range(1, 5)) / 4
    assert acceptance_from_ratio(share, 4) == pytest.approx(a, abs=1e-6)
    assert acceptance_from_ratio(0.0, 4) == 0.0
    with pytest.raises(KvlabError, match=r"within \[0, 1\]"):
        acceptance_from_ratio(1.5, 4)


def _steps() -> StepSeconds:
    model = spec_from_description(params=8e9, bits=4.5)
    return roofline_seconds(model, HardwareSpec.from_name("rtx-4090"), Workload(512, 256), 640)


def test_nothing_accepted_is_pure_cost() -> None:
    p = predict_speculative(_steps(), 4, 0.0, (1,)).points[0]
    assert p.tokens_per_step == 1.0
    assert p.verify_step > p.plain_step and p.speedup < 1.0


def test_near_full_acceptance_nears_k_plus_one_less_the_verify_cost() -> None:
    p = predict_speculative(_steps(), 4, 0.999, (1,)).points[0]
    assert p.speedup == pytest.approx(5 * p.plain_step / p.verify_step, rel=1e-2)
    assert 4.0 < p.speedup < 5.0


def test_a_compute_bound_batch_gains_less() -> None:
    one, many = predict_speculative(_steps(), 4, 0.8, (1, 256)).points
    assert many.speedup < one.speedup


def test_estimate_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    spec = _speculative("4", "--acceptance", "0.8", "--concurrency", "64", capsys=capsys)
    assert spec["k"] == 4 and spec["acceptance"] == 0.8 and spec["acceptance_given"]
    assert spec["proposer"] == "n-gram lookup"
    assert spec["tokens_per_step"] == pytest.approx((1 - 0.8 ** 5) / 0.2)
    one, many = spec["points"]
    assert (one["concurrency"], many["concurrency"]) == (1, 64)
    for p in (one, many):
        assert p["propose"] == 0.0
        assert math.isclose(p["speedup"], p["tok_s"] / p["plain_tok_s"])
        assert p["tok_s"] == pytest.approx(p["tokens_per_step"] / p["verify_step"])


def test_estimate_text_names_the_default_acceptance(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert run_cli(["estimate", *DESCRIBED, "--speculative", "3"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: 3 tokens proposed" in out
    assert "acceptance 0.7 is a stand-in" in out and "1 seq: plain" in out
    assert run_cli(["estimate", *DESCRIBED, "--speculative", "4", "--acceptance", "0"]) == 0
    assert "a slowdown: the verify rows cost more" in capsys.readouterr().out
    assert run_cli(["estimate", *DESCRIBED, "--speculative", "4", "--concurrency", "256"]) == 0
    assert "256 seq" in (out := capsys.readouterr().out) and "the batch is compute-bound" in out
    assert run_cli(["estimate", *DESCRIBED, "--speculative", "4", "--concurrency", "16"]) == 0
    assert "less than alone" in capsys.readouterr().out


def test_a_draft_model_costs_its_passes(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.weights.default_model import default_model_path

    draft = default_model_path()
    if not Path(draft).is_file():
        pytest.skip(f"the default model is not downloaded ({draft})")
    spec = _speculative("3", "--draft-model", str(draft), capsys=capsys)
    assert spec["proposer"].startswith("the draft") and spec["points"][0]["propose"] > 0


@pytest.mark.parametrize(("argv", "match"), [
    (["--acceptance", "0.5"], "--acceptance applies with --speculative"),
    (["--draft-model", "x.gguf"], "--draft-model applies with --speculative"),
    (["--speculative", "4", "--acceptance", "1"], r"in \[0, 1\), got 1.0"),
    (["--speculative", "4", "--acceptance", "-0.1"], r"in \[0, 1\), got -0.1"),
])
def test_refusals(argv: list[str], match: str) -> None:
    with pytest.raises(KvlabError, match=match):
        run_cli(["estimate", *DESCRIBED, *argv])


def test_speculative_k_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_cli(["estimate", *DESCRIBED, "--speculative", "0"])
    assert "must be a positive integer, got 0" in capsys.readouterr().err


def _probe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe cache with round kernel rates, so the bench check needs no minute of probing."""
    from test_estimate_kernel_steps import rates

    from kvlab.probe.cache import ProbeResult, save_probe

    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    save_probe(ProbeResult(bandwidth_gbs=20.0, tflops={"fp32": 0.5, "int8": 1.0},
                           memory_gib=16.0, threads=2, cpu="Test CPU",
                           measured_at="2025-01-02T03:04:05+00:00", kernels=asdict(rates())))


@pytest.mark.slow
def test_bench_estimate_checks_speculative_decode(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.cli.main import main

    _probe_cache(tmp_path, monkeypatch)
    assert main(["bench", "-p", "0", "-n", "32", "-r", "1", "--speculative", "ngram",
                 "--speculative-adaptive", "off", "--estimate"]) == 0
    out = capsys.readouterr().out
    assert "tg32: speculative ngram" in out
    line = next(x for x in out.splitlines() if x.startswith("tg32 speculative tok/s"))
    assert "predicted" in line and "measured" in line and "%" in line


def test_engine_kvlab_prices_the_steps_with_the_step_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from test_estimate_serving import _probe_with_steps

    gguf = _probe_with_steps(tmp_path, monkeypatch)
    assert run_cli(["estimate", str(gguf), "--engine", "kvlab", "--prompt", "40", "--output",
                    "16", "--speculative", "4", "--acceptance", "0", "--concurrency", "8",
                    "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["speculative"]
    assert spec["source"] == "kvlab's step model"
    one, eight = spec["points"]
    assert one["verify_step"] > one["plain_step"] and one["speedup"] < 1.0
    assert eight["plain_step"] > one["plain_step"]


def test_a_run_without_proposals_is_predicted_as_plain_decode() -> None:
    from kvlab.estimate.speculative import SpecCheck, SpecRun

    none = SpecRun(tokens=64, runs=0, drafted=0, accepted=0)
    plain = SpecCheck(none, predict_speculative(_steps(), none.k, none.acceptance, (1,)))
    assert plain.plain_steps == 64 and plain.tok_s == pytest.approx(
        plain.estimate.points[0].plain_tok_s)
    run = SpecRun(tokens=64, runs=16, drafted=64, accepted=48)  # 4 a step, 3 of 4 kept
    assert run.k == 4 and 0.75 < run.acceptance < 1.0
    c = SpecCheck(run, predict_speculative(_steps(), run.k, run.acceptance, (1,)))
    p = c.estimate.points[0]
    assert p.tokens_per_step == pytest.approx(4.0, rel=1e-6)  # 1 + the 3 kept on average
    assert c.plain_steps == pytest.approx(0.0, abs=1e-6)
    assert c.tok_s == pytest.approx(64 / (16 * p.verify_step))
