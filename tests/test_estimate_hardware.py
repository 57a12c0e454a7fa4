"""The built-in hardware table, name lookup, custom figures and the probe cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, known_parts
from kvlab.estimate.hardware import GB, GIB, TERA
from kvlab.probe import resolve_hardware, this_machine
from kvlab.probe.cache import ProbeResult, load_probe, save_probe
from kvlab.probe.machine import measure_bandwidth, measure_matmul

REQUIRED_PARTS = ["cpu-ddr4-laptop", "cpu-ddr5-laptop", "cpu-ddr4-desktop", "cpu-ddr5-desktop",
                  "m1", "m2-pro", "m3-max", "m2-ultra", "m4-pro", "rtx-3060", "rtx-3090",
                  "rtx-4090", "rtx-5090", "a100", "h100", "h200", "mi300x"]


def test_table_covers_the_common_parts_with_sources() -> None:
    parts = {hw.key: hw for hw in known_parts()}
    assert set(REQUIRED_PARTS) <= set(parts)
    for hw in parts.values():
        assert hw.bandwidth > 0 and hw.memory_bytes and hw.memory_bytes > 0
        assert hw.flop_rate() > 0  # the default dtype has a figure
        assert {"bandwidth", "memory", "flops"} <= set(hw.sources)
        assert all(len(text) > 10 for text in hw.sources.values())


def test_table_figures_spot_checks() -> None:
    h100 = HardwareSpec.from_name("h100")
    assert h100.bandwidth == 3350 * GB and h100.memory_bytes == 80 * GIB
    assert h100.flop_rate("bf16") == pytest.approx(989.4 * TERA * 0.7)
    assert HardwareSpec.from_name("m4-pro").bandwidth == 273 * GB  # the exercise's machine


@pytest.mark.parametrize("typed, key", [("RTX 4090", "rtx-4090"), ("nvidia-h100", "h100"),
                                        ("4090", "rtx-4090"), ("Apple M2 Ultra", "m2-ultra"),
                                        ("AMD Instinct MI300X", "mi300x"), ("m4_max", "m4-max")])
def test_name_lookup_forgives_spelling(typed: str, key: str) -> None:
    assert HardwareSpec.from_name(typed).key == key


@pytest.mark.parametrize("typed, suggestion", [("rtx 4900", "rtx-4090"), ("h2000", "h200"),
                                               ("m3-maxx", "m3-max")])
def test_unknown_names_suggest_the_closest(typed: str, suggestion: str) -> None:
    with pytest.raises(KvlabError, match="closest: .*" + suggestion) as info:
        HardwareSpec.from_name(typed)
    assert "--list-hardware" in str(info.value)


@pytest.mark.parametrize("bandwidth, tflops, memory", [(0, 10, None), (-5, 10, None),
                                                      (100, 0, None), (math.nan, 1, None),
                                                      (100, 10, -1)])
def test_impossible_custom_figures(bandwidth: float, tflops: float, memory: float | None) -> None:
    with pytest.raises(KvlabError, match="must be a positive finite number"):
        HardwareSpec.custom(bandwidth, tflops, memory)


def test_overrides_replace_single_figures() -> None:
    hw = HardwareSpec.from_name("rtx-4090").with_overrides(memory_gib=48)
    assert hw.memory_bytes == 48 * GIB and hw.bandwidth == 1008 * GB
    assert hw.sources["memory"] == "user"


def test_this_machine_without_a_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    with pytest.raises(KvlabError, match="run `kvlab probe` first"):
        resolve_hardware("this")
    (tmp_path / "probe.json").write_text("{not json")
    with pytest.raises(KvlabError, match="not a kvlab probe cache"):
        this_machine()


def test_probe_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    result = ProbeResult(bandwidth_gbs=20.0, tflops={"fp32": 0.5}, memory_gib=16.0, threads=4,
                         cpu="Test CPU", measured_at="2025-01-02T03:04:05+00:00",
                         details={"bandwidth": "b", "memory": "m", "fp32": "f"})
    path = save_probe(result)
    assert path == tmp_path / "cache" / "probe.json"
    hw = resolve_hardware("this")
    assert hw.bandwidth == 20 * GB and hw.flop_rate() == 0.5 * TERA
    assert hw.memory_bytes == 16 * GIB and hw.key == "this"
    assert "Test CPU" in hw.name and "kvlab probe 2025-01-02" in hw.sources["bandwidth"]
    assert load_probe(path) == hw


def test_tiny_real_measurements() -> None:
    bandwidth, runs = measure_bandwidth(buffer_mib=8, budget_s=0.05)
    assert bandwidth > 1e8 and runs >= 3
    rate, size, runs = measure_matmul("fp32", size=128, budget_s=0.05)
    assert rate > 1e8 and size == 128 and runs >= 3
