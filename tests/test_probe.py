"""`kvlab probe`'s figures for kvlab's own kernels and engine, on small buffers and tiny
models, and the probe cache across versions."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from kvlab.errors import KvlabError
from kvlab.estimate.kernel_steps import product_calls
from kvlab.estimate.specs import spec_from_gguf
from kvlab.kernels import kernel_backend
from kvlab.probe import kernels as pk
from kvlab.probe import this_machine
from kvlab.probe.cache import PROBE_VERSION, ProbeResult, load_probe, read_probe, save_probe
from kvlab.probe.engine_overhead import (
    SyntheticShape,
    measure_engine_overhead,
    write_synthetic_gguf,
)
from kvlab.probe.kernels import WEIGHT_TYPES, measure_kernels
from kvlab.weights.default_model import default_model_path

TINY = SyntheticShape(hidden=64, inter=128, heads=4, kv_heads=1, head_dim=32, window=4096)


@pytest.fixture(scope="module")
def c_kernels() -> None:
    if kernel_backend() == "torch":
        pytest.skip("kvlab's C kernels are not built")


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_kernel_figures_on_small_buffers(c_kernels: None) -> None:
    for name in ("Q8_0", "Q8_0x8", "Q4_K", "Q4_Kx8", "Q5_0"):
        rate, row = pk.measure_weight_read(name, buffer_mib=1, budget_s=0.02)
        assert _positive(rate) and row >= 0
        assert _positive(pk.measure_prefill(name, 0.02, out_features=64, in_features=256))
    assert pk.measure_call(buffer_mib=1, budget_s=0.02) >= 0
    assert _positive(pk.measure_attention(1, 256, 0.02))
    assert _positive(pk.measure_attention(8, 32, 0.02))
    assert pk.measure_sampling(0.02) >= 0
    ops = pk.measure_row_ops(0.02, rows=8, hidden=64, heads=2, head_dim=32, width=64)
    assert set(ops) == {"norm", "rope", "gelu", "silu"} and all(map(_positive, ops.values()))


def test_measure_kernels_covers_every_weight_type(c_kernels: None) -> None:
    import torch


    threads = torch.get_num_threads()
    k = measure_kernels(budget_s=0.1, weight_mib=1, attention_positions=256, engine=False,
                        rounds=1)
    assert k is not None and k.threads >= 1
    assert set(k.weight_read) == set(k.prefill_ops) == set(WEIGHT_TYPES)
    assert not k.layer_seconds  # engine=False
    assert torch.get_num_threads() == threads  # the sampler's single thread is undone


def test_engine_overhead_on_tiny_models(c_kernels: None) -> None:
    import torch

    threads = torch.get_num_threads()
    o = measure_engine_overhead("gemma3", 1, budget_s=0.05, shape=TINY)
    assert o.per_step >= 0 and o.per_layer >= 0 and o.per_position >= 0
    assert o.per_step < 0.1 and o.per_layer < 0.01  # seconds: glue, not weight reads
    assert torch.get_num_threads() == threads  # the engine's runner changed it; restored


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_synthetic_gguf_reads_as_its_architecture(tmp_path: Path, arch: str) -> None:
    path = tmp_path / "m.gguf"
    write_synthetic_gguf(path, arch, 3, TINY)
    m = spec_from_gguf(path)
    assert m.architecture == arch and m.n_layers == 3 and m.hidden_size == 64
    lyr = m.layers[0]
    assert (lyr.heads, lyr.kv_heads, lyr.ffn_width) == (4, 1, 128)
    assert {x.name for x in lyr.matrices} == {"attn_q", "attn_k", "attn_v", "attn_output",
                                              "ffn_gate", "ffn_up", "ffn_down"}
    assert {x.qtype for x in lyr.matrices} == {"Q8_0"}
    assert product_calls(lyr.matrices) == 4  # q|k|v and gate|up: one product each
    assert m.output_matrix is not None and m.output_matrix.rows == m.vocab_size
    with pytest.raises(ValueError, match="valid: llama, gemma3"):
        write_synthetic_gguf(path, "mamba", 1, TINY)


def test_default_model_matrices() -> None:
    try:
        path = default_model_path()
    except Exception as e:  # noqa: BLE001 - any failure to get the file means: skip
        pytest.skip(f"default model unavailable: {e}")
    m = spec_from_gguf(path)
    assert m.architecture == "gemma3"
    assert m.output_matrix is not None and m.output_matrix.qtype == "Q8_0"
    assert (m.output_matrix.rows, m.output_matrix.cols) == (262144, 640)
    # Q5_0 q|k one product, v (Q8_0 or Q5_0), o, gate|up, down: what kvlab's loader runs
    assert sum(product_calls(lyr.matrices) for lyr in m.layers) + 1 == 82
    assert sum(x.nbytes for lyr in m.layers for x in lyr.matrices) + \
        m.output_matrix.nbytes + 18 * 4 * 2560 + 18 * 2 * 1024 + 2560 == m.weight_bytes


# -- the probe cache -------------------------------------------------------------------------


def _v1_cache() -> dict:
    return {"bandwidth_gbs": 20.0, "tflops": {"fp32": 0.5, "int8": 0.2}, "memory_gib": 16.0,
            "threads": 2, "cpu": "Old CPU", "measured_at": "2025-01-02T03:04:05+00:00",
            "details": {"bandwidth": "b", "memory": "m", "fp32": "f"}, "version": 1}


def _kernels() -> dict:
    from test_estimate_kernel_steps import rates

    return asdict(rates())


def test_version_1_cache_loads_without_kernel_figures(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(_v1_cache()))
    hw = load_probe(path)
    assert hw.bandwidth == 20e9 and hw.kernels is None
    assert read_probe(path).version == 1


def test_kernel_figures_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    result = ProbeResult(**{**_v1_cache(), "version": PROBE_VERSION, "kernels": _kernels()})
    save_probe(result)
    assert json.loads((tmp_path / "probe.json").read_text())["version"] == PROBE_VERSION == 5
    hw = this_machine()
    assert hw.kernels is not None and hw.kernels.weight_read["Q4_Kx8"] == 20e9
    assert hw.kernels.engine("gemma3")[1] == pytest.approx(20e-6)
    assert hw.to_dict()["kernels"]["threads"] == 2


@pytest.mark.parametrize("change", [{"version": 99}, {"kernels": {"threads": 2}}])
def test_unreadable_caches_say_so(tmp_path: Path, change: dict) -> None:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({**_v1_cache(), **change}))
    with pytest.raises(KvlabError, match="run `kvlab probe` again"):
        load_probe(path)
