"""Building blocks shared by the architecture files: norms, rotary embeddings, products.

A weight is either a dense tensor or a `QuantizedWeight` that stays in its GGUF block
format; `linear` and `embed` dispatch on that so model code never cares which.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvlab.config import RopeConfig
from kvlab.kernels import QuantizedWeight, dequantize_rows, qmatmul

Weight = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in] -> [T, out] with w: [out, in]; dense products run in the weight's dtype."""
    if isinstance(w, torch.Tensor):
        y = F.linear(x.to(w.dtype), w)
    else:
        y = qmatmul(x.float(), w)
    return y if bias is None else y + bias


def embed(ids: torch.Tensor, w: Weight) -> torch.Tensor:
    """Rows of the embedding matrix: reads only the rows asked for."""
    if isinstance(w, torch.Tensor):
        return w.index_select(0, ids).float()
    return dequantize_rows(w, ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32; `weight` is the full multiplier (Gemma's 1 + w is folded at load)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with llama3 scaling applied when configured."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.llama3 is None:
        return inv / rope.linear_factor
    factor, low, high, old_len = rope.llama3
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, 1, head_dim] for the given positions (half-rotation layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
