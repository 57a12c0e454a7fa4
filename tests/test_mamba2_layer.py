"""The Mamba-2 mixer (kvlab.models.mamba2_layer) against transformers' GraniteMoeHybrid mamba
layer on a tiny random config: a batch of sequences of unequal lengths in one call, each equal
to transformers' forward on it alone, and decode steps after a prefill equal to the forward
over the whole sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from kvlab.models.mamba2_layer import Mamba2Shape, mamba2_mixer

HIDDEN = 64


def _hf_layer(groups: int) -> GraniteMoeHybridMambaLayer:
    cfg = GraniteMoeHybridConfig(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, layer_types=["mamba"], mamba_n_heads=8, mamba_n_groups=groups,
        mamba_d_state=16, mamba_d_head=16, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=32,
        mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5, hidden_act="silu")
    layer = GraniteMoeHybridMambaLayer(cfg, 0).eval()
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "proj" in name else 0.5))
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=gen).log1p())
        layer.norm.weight.add_(1.0)
    return layer


def _ours(m: GraniteMoeHybridMambaLayer) -> tuple[dict, Mamba2Shape]:
    layer = {"in_proj": m.in_proj.weight, "conv": m.conv1d.weight.squeeze(1),
             "conv_bias": m.conv1d.bias, "dt_bias": m.dt_bias, "ssm_a": -torch.exp(m.A_log.float()),
             "D": m.D, "norm": m.norm.weight, "out_proj": m.out_proj.weight}
    shape = Mamba2Shape(heads=m.num_heads, head_dim=m.head_dim, groups=m.n_groups,
                        state_size=m.ssm_state_size, conv_kernel=m.conv_kernel_size,
                        eps=m.layer_norm_epsilon, time_step_limit=tuple(m.time_step_limit))
    return {k: v.detach() for k, v in layer.items()}, shape


def _states(shape: Mamba2Shape, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv, ssm = shape.state_shapes()
    return torch.zeros(num_slots, *conv), torch.zeros(num_slots, *ssm)


def _close(a, b, rel=1e-4):
    err = (a - b).abs().max() / b.abs().max()
    assert err <= rel, f"relative error {float(err):.3g} > {rel}"


@pytest.mark.parametrize("groups", [1, 2])
def test_a_batch_of_sequences_matches_transformers_on_each(groups):
    m = _hf_layer(groups)
    layer, shape = _ours(m)
    lens = [37, 5, 70]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)) for n in lens]
    conv, ssm = _states(shape, 4)
    with torch.no_grad():
        out = mamba2_mixer(torch.cat(xs), layer, shape, conv, ssm, torch.tensor([2, 0, 3]),
                           torch.tensor(lens))
        refs = [m(x[None])[0] for x in xs]
    _close(out, torch.cat(refs))
    assert not conv[1].any() and not ssm[1].any()  # the slot no sequence uses stays as it was


def test_decode_steps_after_a_prefill_match_transformers_on_the_whole_sequence():
    m = _hf_layer(2)
    layer, shape = _ours(m)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(7))
    conv, ssm = _states(shape, 1)
    slot = torch.tensor([0])
    with torch.no_grad():
        outs = [mamba2_mixer(x[:16], layer, shape, conv, ssm, slot, torch.tensor([16]))]
        outs += [mamba2_mixer(x[t:t + 1], layer, shape, conv, ssm, slot, torch.tensor([1]))
                 for t in range(16, 20)]
        ref = m(x[None])[0]
    _close(torch.cat(outs), ref)
