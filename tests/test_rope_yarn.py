"""YaRN rope scaling: kvlab's inverse frequencies and attention factor against transformers'
_compute_yarn_parameters, from an HF config and from the GGUF keys llama.cpp writes."""

from __future__ import annotations

import pytest
import torch

from kvlab.models.layers import LongRopeTable, RopeTable, ScaledRope, rope_cos_sin, rope_inv_freq
from kvlab.models.spec import gguf_get, gguf_rope, hf_rope

CASES = [
    {"factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # Ministral 3
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},  # gpt-oss
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3 long context
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3
    {"factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_matches_transformers(params, head_dim):
    import transformers as tf
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    theta = 1e6
    rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    cfg = tf.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters=rope_parameters)
    ref_inv, ref_scale = _compute_yarn_parameters(cfg)
    rope = hf_rope({"max_position_embeddings": 131072, "rope_parameters": rope_parameters})
    assert rope.yarn is not None and rope.yarn.attention_factor == pytest.approx(ref_scale)
    inv = rope_inv_freq(rope, head_dim)
    assert torch.allclose(inv, ref_inv, rtol=1e-6, atol=0)
    table = ScaledRope.build(rope, inv)
    pos = torch.tensor([0, 5, 70000])
    cos, sin = rope_cos_sin(pos, table)
    freqs = pos.float()[:, None] * ref_inv[None]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    assert torch.allclose(cos, emb.cos() * ref_scale, atol=1e-5)
    assert torch.allclose(sin, emb.sin() * ref_scale, atol=1e-5)


def test_gguf_yarn_keys_give_the_hf_rope():
    """llama.cpp's keys: factor, original context, betas, and mscale_all_dim written as
    yarn_log_multiplier (its attention factor mscale(f) / mscale(f, log_mul))."""
    meta = {"a.rope.freq_base": 1e6, "a.rope.scaling.type": "yarn",
            "a.rope.scaling.factor": 40.0, "a.rope.scaling.original_context_length": 4096,
            "a.rope.scaling.yarn_beta_fast": 32.0, "a.rope.scaling.yarn_beta_slow": 1.0,
            "a.rope.scaling.yarn_log_multiplier": 0.707}
    hf = hf_rope({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **CASES[3]}})
    assert gguf_rope(gguf_get(meta, "a")) == hf


def test_partial_rotary_leaves_the_other_dimensions_unrotated():
    from kvlab.config import RopeConfig

    inv = rope_inv_freq(RopeConfig(theta=1e4, partial=0.5), 16)
    assert inv.shape == (8,) and torch.equal(inv[4:], torch.zeros(4))
    full8 = rope_inv_freq(RopeConfig(theta=1e4), 8)
    assert torch.equal(inv[:4], full8)


@pytest.mark.parametrize("kind", ["scaled", "longrope"])
def test_rope_table_rows_are_rope_cos_sin(kind):
    """A RopeTable's rows equal rope_cos_sin's values as it grows, across longrope's
    `original` (short factors below, long from there on) and past its limit (computed
    directly); a wide step (a prefill chunk) builds no table, and none exceeds the limit."""
    inv = 1.0 / (1e4 ** (torch.arange(0, 16, 2) / 16))
    rotation = (ScaledRope(inv, 1.3) if kind == "scaled"
                else LongRopeTable(inv, inv / torch.linspace(1, 4, 8), 500, 1.2))
    table = RopeTable(rotation, 1000)
    wide = torch.arange(0, 900)
    assert all(torch.equal(a, b) for a, b in zip(table.cos_sin(wide), rope_cos_sin(wide, rotation)))
    assert table._rows is None
    for step in ([3, 200], [3, 255], [300, 499, 500, 501], [700, 999], [998, 1000, 5000]):
        positions = torch.tensor(step)
        got, want = table.cos_sin(positions), rope_cos_sin(positions, rotation)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert table._rows is not None and table._rows.shape[1] <= 1000
    assert table._rows.shape[1] == 1000
