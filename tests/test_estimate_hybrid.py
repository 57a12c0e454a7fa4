"""The estimator on caches that are not per-head K/V: a hybrid's recurrent layers keep a
fixed-size state per sequence (in memory whatever the context, read and written once per
decode step) and no KV; latent attention caches one latent per token and layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlab.cost import LayerSpec, ModelSpec
from kvlab.estimate import HardwareSpec, Workload, estimate
from kvlab.estimate.report import format_estimate
from kvlab.estimate.roofline import _DecodeSteps
from kvlab.estimate.specs import spec_from_gguf, spec_from_hf_config
from kvlab.models.loader import LoadOptions, load_model, read_config
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_deepseek, build_hybrid, convert_with_llama_cpp

STATE = 8 << 20  # bytes per sequence per recurrent layer
KV = 2 * 8 * 128  # K+V values per token of the attention layer
# Nemotron-H: an MLP-only layer beside its Mamba-2 and attention layers
HYBRIDS = ["lfm2", "qwen3_5", "granitehybrid", "nemotron_h"]


def _hybrid(recurrent: int = 3) -> ModelSpec:
    """`recurrent` recurrent layers and one attention layer, 100 MB of weights each."""
    rec = LayerSpec(dense_bytes=100_000_000, dense_params=50_000_000, state_bytes=STATE)
    attn = LayerSpec(dense_bytes=100_000_000, dense_params=50_000_000, kv_elements=KV,
                     attn_flop_per_key=4 * 32 * 128, heads=32, kv_heads=8)
    layers = (rec,) * recurrent + (attn,)
    return ModelSpec(name="hybrid", source="description", n_params=50_000_000 * len(layers),
                     weight_bytes=100_000_000 * len(layers), layers=layers)


def _step_seconds(model: ModelSpec, contexts: list[float], batch: int = 1) -> np.ndarray:
    steps = _DecodeSteps(model, HardwareSpec.custom(1000, 1000), Workload())
    return steps.seconds(batch, np.array(contexts))[0]


def test_decode_grows_with_context_only_by_attention_kv() -> None:
    model = _hybrid()
    short, long = _step_seconds(model, [1000.0, 101_000.0])
    kv_growth = 100_000 * KV * 2.0  # f16 KV of the one attention layer
    assert long - short == pytest.approx(kv_growth / 1e12)
    # the states are read and written every step, whatever the context
    assert short == pytest.approx((4e8 + 3 * 2 * STATE + 1000 * KV * 2.0) / 1e12)


def test_recurrent_depth_adds_a_flat_cost() -> None:
    """More recurrent layers add their weights and states per step, not per token of context."""
    deep, shallow = _hybrid(recurrent=6), _hybrid(recurrent=3)
    growth = [np.diff(_step_seconds(m, [1000.0, 50_000.0]))[0] for m in (deep, shallow)]
    assert growth[0] == pytest.approx(growth[1])
    extra = _step_seconds(deep, [1000.0])[0] - _step_seconds(shallow, [1000.0])[0]
    assert extra == pytest.approx((3e8 + 3 * 2 * STATE) / 1e12)


def test_memory_holds_states_times_concurrency() -> None:
    model = _hybrid()
    wl = Workload(prompt_tokens=1000, output_tokens=24, concurrency=16)
    e = estimate(model, HardwareSpec.custom(1000, 1000, memory_gib=4), wl)
    kv = 16 * 1024 * KV * 2.0
    assert e.state_bytes_per_seq == 3 * STATE
    assert e.state_bytes == 16 * 3 * STATE
    assert e.kv_bytes == pytest.approx(kv)
    assert e.memory_needed == pytest.approx(4e8 + kv + 16 * 3 * STATE)
    per_seq = 1024 * KV * 2.0 + 3 * STATE
    assert e.max_concurrency == int((4 * 2**30 * 0.9 - 4e8) // per_seq)
    assert any("hybrid: 3 of 4 layers" in n for n in e.notes)
    assert e.to_dict()["model"]["state_bytes_per_seq"] == 3 * STATE


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    for arch in HYBRIDS:
        build_hybrid(arch, root / arch)
    return {arch: root / arch for arch in HYBRIDS}


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hf_config_spec_matches_the_loaded_config(hybrids: dict[str, Path], arch: str) -> None:
    spec = spec_from_hf_config(hybrids[arch] / "hf", bits=32)
    _, config = read_config(open_checkpoint(str(hybrids[arch] / "hf")))
    assert spec.recurrent_layers == config.num_recurrent_layers > 0
    assert spec.state_bytes_per_seq() == config.state_bytes_per_seq() > 0
    assert spec.kv_bytes_per_token(4) == config.kv_bytes_per_token(4)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_gguf_spec_matches_the_loaded_config(hybrids: dict[str, Path], arch: str) -> None:
    """From llama.cpp's converter's metadata (ssm.*, shortconv.l_cache, per-layer KV heads)."""
    gguf = hybrids[arch] / "model.gguf"
    reason = convert_with_llama_cpp(hybrids[arch] / "hf", gguf)
    if reason:
        pytest.skip(reason)
    spec = spec_from_gguf(gguf)
    _, config = read_config(open_checkpoint(str(gguf)))
    assert spec.recurrent_layers == config.num_recurrent_layers > 0
    assert spec.state_bytes_per_seq() == config.state_bytes_per_seq() > 0
    assert spec.kv_bytes_per_token(4) == config.kv_bytes_per_token(4)
    recurrent = [lyr for lyr in spec.layers if lyr.state_bytes]
    assert all(lyr.kv_elements == 0 and lyr.attn_flop_per_key == 0 for lyr in recurrent)
    attention = [lyr for lyr in spec.layers if lyr.kv_elements]
    assert len(attention) == config.num_attention_layers


def test_loaded_model_spec_counts_no_kv_in_mlp_only_layers(hybrids: dict[str, Path]) -> None:
    """Nemotron-H's MLP-only layer: neither KV nor attention FLOP nor a state."""
    loaded = load_model(open_checkpoint(str(hybrids["nemotron_h"] / "hf")), LoadOptions())
    spec = loaded.model_spec()
    assert [bool(lyr.kv_elements) for lyr in spec.layers] == [False, True, False, False]
    assert [bool(lyr.state_bytes) for lyr in spec.layers] == [True, False, True, False]
    assert spec.layers[3].attn_flop_per_key == 0
    assert spec.kv_bytes_per_token(4) == loaded.config.kv_bytes_per_token(4)


def test_report_names_the_states() -> None:
    e = estimate(_hybrid(), HardwareSpec.custom(1000, 1000, memory_gib=4),
                 Workload(prompt_tokens=1000, output_tokens=24, concurrency=2))
    text = format_estimate(e)
    assert "fp32 state per sequence in 3 recurrent layers" in text
    assert "state read and written" in text
    assert "+ states 48.00 MiB" in text  # 2 sequences x 3 layers x 8 MiB


def test_latent_attention_caches_the_latent(tmp_path: Path) -> None:
    """DeepSeek-style MLA: kv_lora_rank + the rotary key part per token and layer, as the
    loaded config counts it, from the HF config and from llama.cpp's GGUF metadata."""
    build_deepseek(tmp_path)
    _, config = read_config(open_checkpoint(str(tmp_path / "hf")))
    assert config.mla is not None
    expected = config.kv_bytes_per_token(2)
    assert spec_from_hf_config(tmp_path / "hf", bits=32).kv_bytes_per_token(2) == expected
    reason = convert_with_llama_cpp(tmp_path / "hf", tmp_path / "model.gguf")
    if reason:
        pytest.skip(reason)
    assert spec_from_gguf(tmp_path / "model.gguf").kv_bytes_per_token(2) == expected


def test_loaded_model_spec_counts_the_states(hybrids: dict[str, Path]) -> None:
    """The engine's own spec of a loaded hybrid (what `kvlab estimate` on a served model and
    the visualiser predict from): states in its recurrent layers, KV in the others."""
    loaded = load_model(open_checkpoint(str(hybrids["qwen3_5"] / "hf")), LoadOptions())
    spec = loaded.model_spec()
    assert spec.state_bytes_per_seq() == loaded.config.state_bytes_per_seq() > 0
    assert spec.kv_bytes_per_token(4) == loaded.config.kv_bytes_per_token(4)
    assert all(lyr.attn_flop_per_key == 0 for lyr in spec.layers if lyr.state_bytes)
