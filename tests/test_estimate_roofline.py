"""Batching, memory fit, offload and input checks of kvlab.estimate.estimate."""

from __future__ import annotations

import json

import pytest

from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, Measurement, ModelSpec, Workload, compare, estimate
from kvlab.estimate.hardware import GIB
from kvlab.estimate.report import format_estimate
from kvlab.estimate.specs import spec_from_description


def _llama_8b(**extra: object) -> ModelSpec:
    return spec_from_description(params=8e9, size_bytes=4.9e9, layers=32, kv_heads=8,
                                      head_dim=128, **extra)


def test_batching_is_linear_until_compute_bound() -> None:
    # 14B, 8.5 GB, 273 GB/s, 20 TFLOPS: memory-bound at 32 tok/s, compute caps at 714 tok/s
    e = estimate(spec_from_description(params=14e9, size_bytes=8.5e9),
                 HardwareSpec.custom(273, 20), Workload(prompt_tokens=3000, output_tokens=200))
    sweep = {p.batch: p for p in e.batch_sweep}
    one = sweep[1].aggregate_tok_s
    assert sweep[16].aggregate_tok_s == pytest.approx(16 * one)
    assert sweep[16].bound == "weights"
    compute_cap = 20e12 / (2 * 14e9)
    assert e.compute_bound_batch == 23  # first batch with 23 x 32.1 > 714
    assert sweep[32].bound == "compute"
    assert sweep[32].aggregate_tok_s == pytest.approx(compute_cap)


def test_kv_reads_bend_the_batch_curve() -> None:
    e = estimate(_llama_8b(), HardwareSpec.custom(1000, 1000),
                 Workload(prompt_tokens=8000, output_tokens=2))
    sweep = {p.batch: p for p in e.batch_sweep}
    assert sweep[1].bound == "weights" and sweep[64].bound == "kv"
    assert sweep[64].aggregate_tok_s < 64 * sweep[1].aggregate_tok_s / 2
    assert e.compute_bound_batch is None  # KV bytes grow as fast as FLOP do


def test_memory_fit_and_largest_concurrency_and_context() -> None:
    model = _llama_8b()
    hw = HardwareSpec.custom(1000, 100, memory_gib=24)
    wl = Workload(prompt_tokens=3000, output_tokens=1000, concurrency=2)
    e = estimate(model, hw, wl)
    usable = 0.9 * 24 * GIB
    per_seq = 4000 * 128 * 1024
    assert e.memory_usable == pytest.approx(usable)
    assert e.memory_needed == pytest.approx(4.9e9 + 2 * per_seq)
    assert e.fits
    assert e.max_concurrency == int((usable - 4.9e9) // per_seq)
    ctx = e.max_context
    assert 4.9e9 + 2 * ctx * 131072 <= usable < 4.9e9 + 2 * (ctx + 1) * 131072
    crowded = estimate(model, hw, Workload(prompt_tokens=3000, output_tokens=1000,
                                           concurrency=e.max_concurrency + 1))
    assert crowded.fits is False
    assert [p.fits for p in e.batch_sweep if p.batch > e.max_concurrency] == \
        [False] * sum(p.batch > e.max_concurrency for p in e.batch_sweep)


def test_weights_too_big_for_memory() -> None:
    e = estimate(_llama_8b(), HardwareSpec.custom(100, 1, memory_gib=4), Workload())
    assert e.fits is False and e.max_concurrency == 0 and e.max_context == 0


def test_unknown_memory_skips_fit_checks() -> None:
    e = estimate(_llama_8b(), HardwareSpec.custom(100, 1), Workload())
    assert e.fits is None and e.max_concurrency is None and e.max_context is None
    assert any("memory size unknown" in n for n in e.notes)


def test_offloading_layers_to_slower_memory() -> None:
    model = spec_from_description(params=8e9, size_bytes=4.9e9, layers=32)
    hw = HardwareSpec.custom(1000, 100, memory_gib=24)
    e = estimate(model, hw, Workload(offload_layers=8, offload_bandwidth=80e9))
    fast, slow = 4.9e9 * 24 / 32, 4.9e9 * 8 / 32
    assert e.offload is not None
    assert e.offload.tok_s_without == pytest.approx(204, abs=0.5)
    assert e.decode_tok_s_ceiling == pytest.approx(1 / (fast / 1000e9 + slow / 80e9), rel=1e-3)
    assert e.offload.fast_memory_saved == pytest.approx(slow, rel=1e-3)
    assert e.memory_needed == pytest.approx(fast, rel=1e-3)
    assert e.batch_sweep[0].bound == "offload"


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_tokens": 0}, "--prompt must be an integer >= 1"),
    ({"concurrency": 0}, "--concurrency"),
    ({"prompt_tokens": 100, "output_tokens": 100, "context": 150}, "shorter than prompt"),
    ({"kv_dtype": "int3"}, "valid: f32, f16, bf16, q8_0"),
    ({"offload_layers": 4}, "needs --offload-bandwidth"),
    ({"offload_layers": 4, "offload_bandwidth": -1e9}, "positive"),
    ({"efficiency": (0.9, 0.5)}, "LOW HIGH"),
])
def test_bad_workloads_say_what_is_valid(kwargs: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        Workload(**kwargs)


def test_offload_beyond_the_layer_count() -> None:
    with pytest.raises(KvlabError, match="valid: 0..32"):
        estimate(_llama_8b(), HardwareSpec.custom(100, 1),
                 Workload(offload_layers=40, offload_bandwidth=50e9))
    with pytest.raises(KvlabError, match="--layers"):
        estimate(spec_from_description(params=8e9, bits=4), HardwareSpec.custom(100, 1),
                 Workload(offload_layers=1, offload_bandwidth=50e9))


def test_context_beyond_the_model_limit() -> None:
    with pytest.raises(KvlabError, match="maximum of 4096"):
        estimate(_llama_8b(max_context=4096), HardwareSpec.custom(100, 1),
                 Workload(prompt_tokens=4000, output_tokens=200))


def test_unknown_dtype_lists_the_valid_ones() -> None:
    with pytest.raises(KvlabError, match="valid: fp32"):
        estimate(_llama_8b(), HardwareSpec.from_name("cpu-ddr5-laptop"),
                 Workload(compute_dtype="bf16"))


def test_estimate_serializes_and_formats() -> None:
    e = estimate(_llama_8b(), HardwareSpec.from_name("rtx-4090"),
                 Workload(concurrency=3, offload_layers=2, offload_bandwidth=64e9))
    data = json.loads(json.dumps(e.to_dict()))
    assert data["hardware"]["key"] == "rtx-4090"
    assert data["batch_sweep"][0]["batch"] == 1
    text = format_estimate(e)
    for needle in ("prefill", "TTFT", "ceiling", "realistic", "fits", "offload", "batch"):
        assert needle in text


def test_compare_puts_prediction_beside_measurement() -> None:
    e = estimate(spec_from_description(params=14e9, size_bytes=8.5e9),
                 HardwareSpec.custom(273, 20), Workload(prompt_tokens=3000, output_tokens=200))
    table = compare(e, Measurement(ttft=5.0, decode_tok_s=24.0, total_seconds=13.3))
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["metric", "predicted"]
    ttft = next(line for line in lines if line.startswith("TTFT"))
    assert "4.2" in ttft and "+19.0%" in ttft  # (5.0 - 4.2) / 4.2
    decode = next(line for line in lines if line.startswith("decode ("))
    assert "in range" in decode
    assert "of the ceiling" in table and "TFLOPS" in table
    assert compare(e, {"decode_tok_s": 40.0}).count("above range") == 1
