"""`kvlab info` on the caches that are not per-head K/V: a hybrid's recurrent state per
sequence and latent attention's latent per token, in text and --json."""

from __future__ import annotations

import json

import pytest
from test_cli import kvlab

from kvlab.models.loader import read_config
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build, build_deepseek, build_hybrid

KINDS = {"lfm2": "short_conv", "qwen3_5": "gated_delta", "granitehybrid": "mamba2",
         "nemotron_h": "mamba2"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("info")
    for arch in KINDS:
        build_hybrid(arch, root / arch)
    build_deepseek(root / "deepseek")
    return {name: str(root / name / "hf") for name in (*KINDS, "deepseek")}


def info_json(path: str) -> dict:
    proc = kvlab("info", path, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("arch", list(KINDS))
def test_hybrid_reports_recurrent_layers_and_state(models: dict, arch: str) -> None:
    info = info_json(models[arch])
    _, c = read_config(open_checkpoint(models[arch]))
    recurrent = [i for i in range(c.num_layers) if c.is_recurrent(i)]
    attention = [i for i in range(c.num_layers) if c.is_attention(i)]
    assert info["recurrent_kind"] == KINDS[arch]
    assert info["recurrent_layers"] == len(recurrent) > 0
    assert info["attention_layers"] == len(attention) > 0
    # Nemotron-H's MLP-only layers keep neither
    assert info["mlp_only_layers"] == c.num_layers - len(recurrent) - len(attention)
    # KV counts the attention layers only: 2 x kv_heads x head_dim each
    per_layer = 2 * c.num_kv_heads * c.head_dim
    assert info["kv_bytes_per_token_f32"] == 4 * per_layer * info["attention_layers"]
    rc = c.recurrent
    state = rc.conv_state_shape[0] * rc.conv_state_shape[1]
    if rc.recurrent_state_shape:
        h, k, v = rc.recurrent_state_shape
        state += h * k * v
    assert info["state_bytes_per_seq"] == 4 * state * len(recurrent)
    assert info["conv_state_shape"] == list(rc.conv_state_shape)


def test_hybrid_text_names_the_state(models: dict) -> None:
    proc = kvlab("info", models["qwen3_5"])
    assert proc.returncode == 0, proc.stderr
    info = info_json(models["qwen3_5"])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("recurrent"))
    assert f"{info['recurrent_layers']} gated_delta layers" in line
    assert f"{info['state_bytes_per_seq'] / 1024:.1f} KiB per sequence" in line
    assert "the attention layers only (1 of 4)" in proc.stdout


def test_mlp_only_layers_are_named_beside_the_attention_layers(models: dict) -> None:
    proc = kvlab("info", models["nemotron_h"])
    assert proc.returncode == 0, proc.stderr
    assert "the attention layers only (1 of 4)" in proc.stdout
    assert "nor does the 1 MLP-only layer" in proc.stdout


def test_dense_model_has_no_recurrent_or_latent_fields(tiny_gguf_path: str) -> None:
    info = info_json(tiny_gguf_path)
    assert "recurrent_layers" not in info and "latent_width" not in info


def test_mla_reports_latent_and_expanded_kv(models: dict) -> None:
    info = info_json(models["deepseek"])
    _, c = read_config(open_checkpoint(models["deepseek"]))
    mla = c.mla
    assert info["latent_width"] == mla.kv_lora_rank + mla.qk_rope_head_dim
    assert info["latent_bytes_per_token_f16"] == 2 * c.num_layers * info["latent_width"]
    assert info["kv_bytes_per_token_f16"] == info["latent_bytes_per_token_f16"]
    key = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    expanded = 2 * c.num_layers * c.num_heads * (key + mla.v_head_dim)
    assert info["expanded_kv_bytes_per_token_f16"] == expanded
    assert expanded > info["latent_bytes_per_token_f16"]
    text = kvlab("info", models["deepseek"]).stdout
    assert f"{info['latent_width']} values per token per layer" in text


@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("dense")
    build("qwen2", out)
    return str(out / "model.gguf")
