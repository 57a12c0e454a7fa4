"""The tensor-parallel and replica arithmetic of kvlab.estimate.parallel, by hand on round numbers."""

from __future__ import annotations

import json
import math

import pytest

from kvlab.cli.main import main
from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, LayerSpec, ModelSpec, Workload, estimate
from kvlab.estimate.hardware import Interconnect
from kvlab.estimate.parallel import allreduce_seconds, predict_parallel

LINK = Interconnect("test link", bandwidth=100e9, latency=5e-6)


def two_layers(kv_heads: int = 2) -> ModelSpec:
    """Two blocks of 1 GB (1e9 params each), a 0.5 GB head with no FLOP, hidden 1000."""
    layer = LayerSpec(dense_bytes=10**9, dense_params=10**9, kv_elements=1000, heads=4,
                      kv_heads=kv_heads)
    return ModelSpec(name="two", source="description", n_params=2 * 10**9,
                     weight_bytes=int(2.5e9), layers=(layer, layer), output_bytes=int(5e8),
                     hidden_size=1000)


def test_a_ring_all_reduce_costs_its_hops_and_its_bytes():
    # 4 ranks: 2 x 3 hops of 5 us, and 2 x 3/4 of 1 MB at 100 GB/s
    assert allreduce_seconds(1e6, 4, LINK) == pytest.approx(30e-6 + 15e-6)
    assert allreduce_seconds(1e6, 1, LINK) == 0.0


def test_tensor_parallel_splits_the_blocks_and_adds_the_all_reduces():
    model, hw = two_layers(), HardwareSpec.custom(1000, 1000)  # compute far from binding
    wl = Workload(prompt_tokens=100, output_tokens=101, kv_dtype="f16")
    single = estimate(model, hw, wl)
    p = predict_parallel(model, hw, wl, single, size=2, link=LINK)
    assert p.rank_weight_bytes == pytest.approx(0.5e9 + 2e9 / 2)  # head whole, blocks halved
    # KV at the reply's middle (150.5 tokens): 2 layers x 1000 values x 2 B, half per rank
    assert p.rank_kv_bytes == pytest.approx(150.5 * 2 * 1000 * 2 / 2)
    assert p.allreduce_bytes == 1000 * 4  # one row of fp32 activations
    one_reduce = 2 * 5e-6 + 4000 / 100e9
    assert p.allreduce_seconds == pytest.approx(2 * 2 * one_reduce)
    assert p.step_seconds == pytest.approx((1.5e9 + 301_000) / 1e12 + 4 * one_reduce)
    assert p.speedup == pytest.approx(1 / single.decode_tok_s_ceiling / p.step_seconds)


def test_fewer_kv_heads_than_ranks_replicate_the_kv_cache():
    model, hw = two_layers(kv_heads=1), HardwareSpec.custom(1000, 1000)
    wl = Workload(prompt_tokens=100, output_tokens=101, kv_dtype="f16")
    p = predict_parallel(model, hw, wl, estimate(model, hw, wl), size=2, link=LINK)
    assert p.rank_kv_bytes == pytest.approx(150.5 * 2 * 1000 * 2)  # every rank: the one head


def test_replicas_for_a_target_rate():
    model, hw = two_layers(), HardwareSpec.custom(1000, 1000)
    wl = Workload(prompt_tokens=100, output_tokens=101, concurrency=4, kv_dtype="f16")
    single = estimate(model, hw, wl)
    p = predict_parallel(model, hw, wl, single, replicas=3, target_rps=50.0)
    one = 4 / (p.ttft + 100 * p.step_seconds / wl.efficiency_mid)
    assert p.requests_per_s == pytest.approx(3 * one)
    assert p.replicas_needed == math.ceil(50.0 / one)
    assert p.allreduce_seconds == 0 and p.link is None and p.ttft == single.prefill_seconds


def test_a_split_the_heads_refuse_or_a_missing_link_is_an_error():
    model, hw = two_layers(), HardwareSpec.custom(1000, 1000)
    wl = Workload()
    single = estimate(model, hw, wl)
    with pytest.raises(KvlabError, match="4 attention heads cannot be split 3 ways"):
        predict_parallel(model, hw, wl, single, size=3, link=LINK)
    with pytest.raises(KvlabError, match="--link-bandwidth"):
        predict_parallel(model, hw, wl, single, size=2)


def test_catalogue_parts_carry_their_interconnect():
    assert HardwareSpec.from_name("h100").interconnect.bandwidth == 450e9
    assert HardwareSpec.from_name("rtx-4090").interconnect.name == "PCIe 4.0 x16"
    assert HardwareSpec.from_name("ddr5-desktop").interconnect.name.startswith("10 GbE")


def test_estimate_cli_prints_the_configuration(capsys):
    args = ["estimate", "--hardware", "h100", "--params", "8e9", "--bits", "16", "--layers",
            "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--head-dim", "128"]
    assert main(args + ["--tensor-parallel-size", "2", "--replicas", "2", "--target-rps", "5",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["parallel"]
    assert out["tensor_parallel_size"] == 2 and out["replicas"] == 2
    assert out["link"]["name"] == "NVLink 4" and out["replicas_needed"] >= 1
    assert main(args + ["--tp", "2", "--link-bandwidth", "25", "--link-latency", "20"]) == 0
    assert "tensor parallel 2 over the given link" in capsys.readouterr().out
