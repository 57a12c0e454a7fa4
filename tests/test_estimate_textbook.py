"""The worked numbers of shared/seed/how-generation-works.txt, reproduced by kvlab.estimate."""

from __future__ import annotations

import pytest

from kvlab.estimate import HardwareSpec, Workload, estimate
from kvlab.estimate.specs import spec_from_description

LLAMA_8B_Q4 = {"params": 8e9, "size_bytes": 4.9e9}  # "8B at 4-bit, about 4.9 GB"


@pytest.mark.parametrize("bandwidth_gbs, ceiling", [(80, 16), (200, 41), (450, 92), (1000, 204)])
def test_decode_ceiling_is_bandwidth_over_model_size(bandwidth_gbs: float, ceiling: int) -> None:
    e = estimate(spec_from_description(**LLAMA_8B_Q4),
                 HardwareSpec.custom(bandwidth_gbs, tflops=40), Workload())
    assert round(e.decode_tok_s_ceiling) == ceiling
    low, high = e.decode_tok_s_realistic
    assert low == pytest.approx(0.60 * e.decode_tok_s_ceiling)
    assert high == pytest.approx(0.85 * e.decode_tok_s_ceiling)


def test_quiz_4_9_gb_at_500_gb_s_is_about_100_tok_s() -> None:
    e = estimate(spec_from_description(**LLAMA_8B_Q4), HardwareSpec.custom(500, 40),
                 Workload())
    assert e.decode_tok_s_ceiling == pytest.approx(100, rel=0.03)


def test_prefill_8b_4000_tokens_at_40_tflops() -> None:
    e = estimate(spec_from_description(**LLAMA_8B_Q4), HardwareSpec.custom(1000, 40),
                 Workload(prompt_tokens=4000, output_tokens=300))
    assert e.prefill_flop_per_token == pytest.approx(16e9)  # 2 x 8e9
    assert e.prefill_flop == pytest.approx(64e12)
    assert e.prefill_seconds == pytest.approx(1.6)
    assert e.prefill_bound == "compute"
    assert e.ttft == e.prefill_seconds


def test_response_time_1_6_s_plus_300_tokens_at_90_tok_s() -> None:
    # 90 tok/s as the achieved speed: bandwidth 441 GB/s, efficiency pinned at 100 %
    e = estimate(spec_from_description(**LLAMA_8B_Q4), HardwareSpec.custom(441, 40),
                 Workload(prompt_tokens=4000, output_tokens=300, efficiency=(1.0, 1.0)))
    assert e.decode_tok_s_ceiling == pytest.approx(90)
    assert e.total_seconds == pytest.approx(4.9, abs=0.05)  # 1.6 + 299 / 90


def test_exercise_14b_on_273_gb_s_and_20_tflops() -> None:
    e = estimate(spec_from_description(params=14e9, size_bytes=8.5e9),
                 HardwareSpec.custom(273, 20), Workload(prompt_tokens=3000, output_tokens=200))
    assert round(e.decode_tok_s_ceiling) == 32
    low, high = e.decode_tok_s_realistic
    assert 19 <= low <= 20 and 27 <= high <= 28  # "about 20 to 27"
    assert e.prefill_flop_per_token == pytest.approx(28e9)
    assert e.prefill_flop == pytest.approx(84e12)
    assert e.prefill_seconds == pytest.approx(4.2)
    assert e.total_seconds == pytest.approx(13, abs=0.5)


def test_llama_3_1_8b_kv_cache_is_128_kib_per_token_in_f16() -> None:
    model = spec_from_description(params=8e9, bits=4.5, layers=32, kv_heads=8, head_dim=128)
    assert model.kv_bytes_per_token(2.0) == 128 * 1024
    e = estimate(model, HardwareSpec.custom(1000, 40, memory_gib=24),
                 Workload(prompt_tokens=2000, output_tokens=500, concurrency=4))
    assert e.kv_bytes_per_token == 128 * 1024
    assert e.kv_bytes == 128 * 1024 * 2500 * 4  # grows with context, multiplies with sequences


def test_long_context_slows_decode() -> None:
    model = spec_from_description(params=8e9, size_bytes=4.9e9, layers=32, kv_heads=8,
                                       head_dim=128)
    hw = HardwareSpec.custom(1000, 40)
    short = estimate(model, hw, Workload(prompt_tokens=100, output_tokens=100))
    long = estimate(model, hw, Workload(prompt_tokens=30000, output_tokens=100))
    assert long.decode_tok_s_ceiling < short.decode_tok_s_ceiling
    # 30k tokens x 128 KiB = 4.0 GB of KV read per step on top of 4.9 GB of weights
    assert long.decode_tok_s_ceiling == pytest.approx(1000e9 / (4.9e9 + 30100 * 131072), rel=0.01)
