"""The Mamba-2 mixer of hybrid families (Granite 4 hybrid, Nemotron-H): one layer's token
mixing from its conv and SSM states, each sequence of the batch from its own state slot.

    z | xBC | dt = in_proj(h)                    z, x [T, d_inner]; B, C [T, G * N]; dt [T, H]
    xBC = silu(conv(xBC))                        causal depthwise conv, width K, from conv state
    y = ssd_scan(x, softplus(dt + dt_bias), A, B, C, D)   from and into the SSM state
    out = out_proj(rms_norm_groups(y * silu(z)) * norm_weight)

The ops are kvlab.kernels.recurrent's; this module owns the split of in_proj's output and
the order of the steps (transformers' GraniteMoeHybridMambaLayer.torch_forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.kernels.recurrent import gated_rms_norm, short_conv, ssd_scan
from kvlab.models.layers import linear


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer's dimensions: heads x head_dim = d_inner, groups of B and C with
    state_size each, conv width conv_kernel; dt clamped to time_step_limit."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int
    eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """x, B and C: the channels the conv runs over (and its state holds)."""
        return self.d_inner + 2 * self.groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's conv state [K-1, conv_channels] and SSM state [H, P, N]."""
        return ((self.conv_kernel - 1, self.conv_channels),
                (self.heads, self.head_dim, self.state_size))


def mamba2_mixer(h: torch.Tensor, layer: dict[str, Any], shape: Mamba2Shape,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
    """h [T, hidden] -> [T, hidden]. layer: "in_proj" [d_inner + conv_channels + H, hidden],
    "conv" [conv_channels, K], "dt_bias" [H], "ssm_a" (A = -exp(A_log)) [H], "D" [H],
    "norm" [d_inner], "out_proj" [hidden, d_inner]; optional "in_proj_bias", "conv_bias",
    "out_proj_bias". conv_state [num_slots, K-1, conv_channels] and ssm_state
    [num_slots, H, P, N] fp32, rows slots[s] read and updated for sequence s (lens[s] tokens)."""
    s = shape
    G, N = s.groups, s.state_size
    z, xbc, dt = linear(h, layer["in_proj"], layer.get("in_proj_bias")).split(
        [s.d_inner, s.conv_channels, s.heads], dim=-1)
    xbc = short_conv(xbc.contiguous(), layer["conv"], conv_state, slots, lens,
                     bias=layer.get("conv_bias"), activation="silu")
    x, B, C = xbc.split([s.d_inner, G * N, G * N], dim=-1)
    dt = F.softplus(dt.float() + layer["dt_bias"]).clamp(*s.time_step_limit)
    y = ssd_scan(x.reshape(-1, s.heads, s.head_dim), dt, layer["ssm_a"], B.reshape(-1, G, N),
                 C.reshape(-1, G, N), layer["D"], ssm_state, slots, lens)
    y = gated_rms_norm(y.reshape(-1, s.d_inner), z, layer["norm"], s.eps,
                       group_size=s.d_inner // G, norm_before_gate=False)
    return linear(y, layer["out_proj"], layer.get("out_proj_bias"))
