"""`kvlab estimate` and `kvlab probe` through their argparse registration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvlab.cli import estimate as estimate_cli
from kvlab.cli import probe as probe_cli
from kvlab.errors import KvlabError
from kvlab.probe.cache import ProbeResult
from kvlab.weights.default_model import default_model_path


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvlab")
    sub = parser.add_subparsers(dest="command", required=True)
    estimate_cli.register(sub)
    probe_cli.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_textbook_description_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["estimate", "--params", "14B", "--size-gb", "8.5", "--bandwidth", "273",
                    "--tflops", "20", "--prompt", "3000", "--output", "200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert round(data["decode_tok_s_ceiling"]) == 32
    assert data["prefill_flop"] == pytest.approx(84e12)
    assert data["prefill_seconds"] == pytest.approx(4.2)
    assert data["total_seconds"] == pytest.approx(13, abs=0.5)


def test_default_model_on_a_known_part(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        default_model_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"default model unavailable: {e}")
    assert run_cli(["estimate", "--hardware", "rtx 3060", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert "Gemma 3 270m" in out and "embedding 62.6%" in out
    assert "reads 246.6 MB of weights" in out
    assert "KV 3.0 KiB/token f16 in full-attention layers + 7.50 MiB fixed" in out
    assert "sliding window 512 on 15 of 18 layers" in out


def test_hardware_this_after_a_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    fake = ProbeResult(bandwidth_gbs=25.0, tflops={"fp32": 0.2}, memory_gib=16.0, threads=2,
                       cpu="Fake CPU", measured_at="2025-01-02T03:04:05+00:00",
                       details={"bandwidth": "sum", "memory": "sysconf", "fp32": "mm"})
    monkeypatch.setattr(probe_cli, "probe", lambda threads, bf16, **_: fake)
    assert run_cli(["probe", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "25.0 GB/s" in out and "200.0 GFLOP/s" in out and str(tmp_path) in out
    assert run_cli(["estimate", "--params", "8e9", "--size-gb", "4.9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["key"] == "this"
    assert data["decode_tok_s_ceiling"] == pytest.approx(25 / 4.9)


def test_list_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["estimate", "--list-hardware"]) == 0
    out = capsys.readouterr().out
    assert "rtx-4090" in out and "mi300x" in out and "m4-pro" in out


def test_plot_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "roofline.png"
    assert run_cli(["estimate", "--params", "8e9", "--bits", "4.5", "--layers", "32",
                    "--kv-heads", "8", "--head-dim", "128", "--hardware", "m4-pro",
                    "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--params", "8e9", "--bits", "4", "--hardware", "rtx4900"], "closest: rtx-4090"),
    (["model.gguf", "--params", "8e9"], "not both"),
    (["--params", "8e9", "--bits", "4", "--bandwidth", "100"], "--tflops"),
    (["--params", "8e9", "--bits", "4", "--bandwidth", "-100", "--tflops", "1"], "positive"),
    (["--params", "8e9", "--bits", "4", "--hardware", "h100", "--offload-layers", "2"],
     "--offload-bandwidth"),
    (["--params", "8e9", "--bits", "4", "--hardware", "h100", "--plot", "out.svg"], ".png"),
])
def test_user_errors_are_kvlab_errors(argv: list[str], message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        run_cli(["estimate", *argv])


def test_bad_counts_are_rejected_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run_cli(["estimate", "--params", "lots"])
    assert info.value.code == 2
    assert "write 8e9, 8B or 270M" in capsys.readouterr().err
