"""Building blocks shared by the architecture files: norms, rotary embeddings, products.

A weight is either a dense tensor, a `QuantizedWeight` that stays in its GGUF block
format (CPU), or a `PackedWeight`, the same blocks in planes on a CUDA device (Triton
kernels, kvlab.gpu); `linear` and `embed` dispatch on that so model code never cares
which. Norms,
RoPE and GeGLU on fp32 CPU tensors run as single C calls (kvlab.kernels.fused), the torch
ops otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.config import RopeConfig
from kvlab.errors import ModelLoadError
from kvlab.kernels import QuantizedWeight, dequantize_rows, fused, qmatmul, qmatmul_stacked, scratch
from kvlab.kernels.hugepages import weight_buffer
from kvlab.kernels.packed import PACKED_TYPES, PackedWeight, concat_rows

# packed GGUF weights multiply through Triton kernels: imported only where they can run (a
# CUDA device, or the CPU under Triton's interpreter), as triton's import takes a while
if find_spec("triton") is not None and (torch.cuda.is_available()
                                        or os.environ.get("TRITON_INTERPRET") == "1"):
    from kvlab.gpu import quant_matmul
else:
    quant_matmul = None

Weight = torch.Tensor | QuantizedWeight | PackedWeight


@dataclass(frozen=True)
class Stacked:
    """Matrices that share an input, multiplied as one: [sum(out), in].

    Rows of the same storage type are concatenated at load into one matrix, so q/k/v or
    gate/up cost one kernel call (one pass over x) instead of several; `parts` is what is
    left when types differ (Gemma 3's q and k are Q5_0, its v is Q8_0).
    """

    parts: tuple[Weight, ...]
    sizes: tuple[int, ...]  # out features of each original matrix, for splitting the result

    all_quantized: bool = field(init=False)  # then one decode row needs no torch.cat

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_quantized",
                           all(isinstance(p, QuantizedWeight) for p in self.parts))

    @classmethod
    def of(cls, weights: list[Weight]) -> Stacked:
        sizes = tuple(w.shape[0] for w in weights)
        parts: list[Weight] = []
        for w in weights:
            if parts and _same_storage(parts[-1], w):
                parts[-1] = _concat_rows(parts[-1], w)
            else:
                parts.append(w)
        return cls(tuple(parts), sizes)


def _same_storage(a: Weight, b: Weight) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]
    if isinstance(a, PackedWeight) and isinstance(b, PackedWeight):
        return (a.qtype, a.shape[1], a.dtype) == (b.qtype, b.shape[1], b.dtype)
    return (isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
            and a.qtype == b.qtype and a.grouped == b.grouped and a.shape[1] == b.shape[1])


def _concat_rows(a: Weight, b: Weight) -> Weight:
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])
    if isinstance(a, PackedWeight):
        return concat_rows(a, b)
    data = weight_buffer(a.data.numel() + b.data.numel()).view(-1, a.data.shape[1])
    torch.cat([a.data, b.data], out=data)  # whole groups
    return QuantizedWeight(a.qtype, (a.shape[0] + b.shape[0], a.shape[1]), data,
                           grouped=a.grouped)


def linear(x: torch.Tensor, w: Weight | Stacked, bias: torch.Tensor | None = None,
           transient: bool = False) -> torch.Tensor:
    """x: [T, in] -> [T, out] with w: [out, in]; dense products run in the weight's dtype.

    transient: the caller consumes the result before its thread's next transient product,
    so a large quantized product may be written into a kept buffer (kernels/scratch.py)."""
    if isinstance(w, Stacked) and len(w.parts) == 1:
        y = linear(x, w.parts[0], transient=transient)
    elif isinstance(w, Stacked) and w.all_quantized:
        y = qmatmul_stacked(as_dtype(x, torch.float32), w.parts)  # decode: no torch.cat
    elif isinstance(w, Stacked):
        y = torch.cat([linear(x, part) for part in w.parts], dim=-1)
    elif isinstance(w, torch.Tensor):
        y = F.linear(as_dtype(x, w.dtype), w)
    elif isinstance(w, PackedWeight):
        y = quant_matmul.linear(x, w)
    else:
        out = scratch.take(x.shape[0], w.shape[0]) if transient and x.dim() == 2 else None
        y = qmatmul(as_dtype(x, torch.float32), w, out)
    return y if bias is None else y + bias


def packs_on(w: QuantizedWeight, device: str | torch.device) -> bool:
    """Whether w can stay in its blocks on `device`: a CUDA device with the Triton kernels
    present (triton installed) and a type they multiply (kvlab.kernels.packed)."""
    return (quant_matmul is not None and torch.device(device).type == "cuda"
            and w.qtype in PACKED_TYPES and not w.grouped)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: itself where it is already (a no-op .to still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def split(y: torch.Tensor, w: Stacked) -> tuple[torch.Tensor, ...]:
    """The output of a Stacked product, back into one tensor per original matrix."""
    return y.split_with_sizes(w.sizes, dim=-1)


def embed(ids: torch.Tensor, w: Weight) -> torch.Tensor:
    """Rows of the embedding matrix: reads only the rows asked for."""
    if isinstance(w, torch.Tensor):
        return as_dtype(w.index_select(0, ids), torch.float32)
    if isinstance(w, PackedWeight):
        return quant_matmul.dequantize_rows(w, ids)
    return dequantize_rows(w, ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32; `weight` is the full multiplier (Gemma's 1 + w is folded at load)."""
    if fused.fits(x, weight) and weight.dim() == 1 and x.shape[-1] == weight.shape[0]:
        # one C call instead of torch's several kernels
        return fused.rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x + rms_norm(h) (Gemma's post-norms); updates x in place on the C path, so x must
    be the caller's own residual stream."""
    if (fused.fits(x, h, weight) and x.is_contiguous() and x.shape == h.shape
            and weight.dim() == 1 and x.shape[-1] == weight.shape[0]):
        return fused.add_rms_norm_(x, h, weight, eps)
    return x + rms_norm(h, weight, eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with llama3 or YaRN scaling applied when configured.

    Partial rotary (rope.partial < 1): the first rotary_dim / 2 frequencies, then zeros (cos 1,
    sin 0: those dimension pairs pass unchanged); the family's loader lays each head's rows out
    so that pairs (j, j + head_dim / 2) are the rotated ones (permute_partial_rotary)."""
    dim = int(head_dim * rope.partial)
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inv = _yarn(inv, rope, dim) if rope.yarn is not None else _llama3(inv, rope)
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - dim // 2)])


def _yarn(inv: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's blend of interpolated (inv / factor) and kept frequencies, as transformers'
    _compute_yarn_parameters: kept below the ramp's low dimension, interpolated above its
    high one."""
    y = rope.yarn
    assert y is not None

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv / y.factor * (1 - keep) + inv * keep


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    if rope.llama3 is None:
        return inv / rope.linear_factor
    factor, low, high, old_len = rope.llama3
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def permute_partial_rotary(t: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows of q or k (or their bias, or a per-head norm weight) rearranged in each head so
    that partial rotary becomes a full-width half rotation: a head's rotated pairs (j, j +
    rotary_dim / 2) move to (j, j + head_dim / 2), the unrotated dimensions fill the rest,
    half each side. Rotating those with zero frequencies (rope_inv_freq) leaves them as
    they are; q and k move alike, so their dot products are unchanged.

        head_dim 8, rotary_dim 4:  old [r0 r1 R0 R1 p0 p1 p2 p3] -> new [r0 r1 p0 p1 R0 R1 p2 p3]
    """
    half, rot_half = head_dim // 2, rotary_dim // 2
    passed = (head_dim - rotary_dim) // 2
    order = torch.cat([torch.arange(rot_half), rotary_dim + torch.arange(passed),
                       rot_half + torch.arange(rot_half),
                       rotary_dim + passed + torch.arange(passed)])
    assert order.numel() == 2 * half
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


@dataclass(frozen=True)
class LongRopeTable:
    """Longrope's two frequency sets: `short` [head_dim / 2] for positions below `original`,
    `long` from there on (per position, so a sequence's cached keys never change as it
    grows: transformers' choice for decoding, one token past `original` at a time), and
    cos/sin scaled by `scale`."""

    short: torch.Tensor
    long: torch.Tensor
    original: int
    scale: float

    @classmethod
    def build(cls, rope: RopeConfig, head_dim: int, weights: dict[str, Any]) -> LongRopeTable:
        """From the config's factors, or from a GGUF's rope_short / rope_long tensors."""
        lr = rope.longrope
        assert lr is not None
        base = rope_inv_freq(dataclasses.replace(rope, longrope=None), head_dim)
        sets = []
        for name, given in (("rope_short", lr.short), ("rope_long", lr.long)):
            factors = (weights[name].float().cpu() if name in weights else
                       torch.tensor(given, dtype=torch.float32) if given is not None else None)
            if factors is None or factors.shape != base.shape:
                raise ModelLoadError(f"longrope needs {base.numel()} {name[5:]} factors, got "
                                     f"{None if factors is None else tuple(factors.shape)}")
            sets.append(base / factors)
        return cls(sets[0], sets[1], lr.original, lr.attention_factor)

    def to(self, device: torch.device) -> LongRopeTable:
        return dataclasses.replace(self, short=self.short.to(device), long=self.long.to(device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = torch.where((positions >= self.original)[:, None], self.long[None, :],
                          self.short[None, :])  # [T, head_dim / 2]
        freqs = positions.float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos() * self.scale, emb.sin() * self.scale


@dataclass(frozen=True)
class ScaledRope:
    """Inverse frequencies whose cos/sin are multiplied by `scale` (YaRN's attention factor)."""

    inv_freq: torch.Tensor  # [head_dim / 2]
    scale: float

    @classmethod
    def build(cls, rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor | ScaledRope:
        """inv_freq alone when rope scales nothing, else with YaRN's attention factor."""
        scale = rope.yarn.attention_factor if rope.yarn is not None else 1.0
        return inv_freq if scale == 1.0 else cls(inv_freq, scale)

    def to(self, device: torch.device) -> ScaledRope:
        return dataclasses.replace(self, inv_freq=self.inv_freq.to(device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        return cos * self.scale, sin * self.scale


class RopeTable:
    """A rotation (inverse frequencies, ScaledRope or LongRopeTable) whose cos/sin are kept
    for positions 0..P-1, P growing by doubling up to `limit` positions (the model's
    max_position_embeddings, at most MAX_ROWS: a table stays a few MiB even for 512-wide
    heads): a CPU decode step takes its rows with one index_select. Row p holds
    rope_cos_sin's values of position p (each is a function of its position alone). Wider
    steps (prefill chunks) and positions past `limit` are computed directly, so a long
    prompt builds no table; past MAX_ROWS a step's attention outweighs its cos/sin anyway.
    On other devices cos/sin are computed per step: the size check would wait for the
    device, and a captured graph must compute them itself."""

    NARROW = 256  # most positions a step takes from the table: a decode batch's rows
    MAX_ROWS = 8192

    def __init__(self, rotation: torch.Tensor | LongRopeTable | ScaledRope, limit: int) -> None:
        self.rotation, self.limit = rotation, min(limit, self.MAX_ROWS)
        frequencies = (rotation.short if isinstance(rotation, LongRopeTable) else
                       rotation.inv_freq if isinstance(rotation, ScaledRope) else rotation)
        self.on_cpu = frequencies.is_cpu
        self._rows: torch.Tensor | None = None  # [2, P, 1, head_dim]: cos, sin (CPU)

    def to(self, device: torch.device) -> RopeTable:
        return RopeTable(self.rotation.to(device), self.limit)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (positions.is_cpu and self.on_cpu) or not 0 < positions.numel() <= self.NARROW:
            return rope_cos_sin(positions, self.rotation)
        rows = self._rows
        needed = int(positions.max()) + 1
        if rows is None or rows.shape[1] < needed:
            if needed > self.limit:
                return rope_cos_sin(positions, self.rotation)
            rows = self._grow(needed)
        cos, sin = rows.index_select(1, positions)
        return cos, sin

    def _grow(self, needed: int) -> torch.Tensor:
        """The table over at least `needed` <= limit positions (a power of two, 256 at
        least, or `limit`)."""
        size = min(self.limit, max(256, 1 << (needed - 1).bit_length()))
        rows = torch.stack(rope_cos_sin(torch.arange(size), self.rotation))
        self._rows = rows  # replaced whole: a reader holds the old one or the new one
        return rows


def rope_cos_sin(positions: torch.Tensor,
                 inv_freq: torch.Tensor | LongRopeTable | ScaledRope | RopeTable
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, 1, head_dim] for the given positions (half-rotation layout)."""
    if isinstance(inv_freq, LongRopeTable | ScaledRope | RopeTable):
        return inv_freq.cos_sin(positions)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    if x.is_cuda:  # one kernel fewer; on CPUs the products round as the C path does
        return torch.addcmul(x * cos, rotated, sin)
    return x * cos + rotated * sin


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, eps: float) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight)) per head (QK-norm), or RoPE alone if weight is None.

    x: [T, heads, head_dim], a fresh product output: the C path rotates it in place.
    """
    if (fused.fits(x, cos, sin) and fused.heads_packed(x)
            and cos.numel() == sin.numel() == x.shape[0] * x.shape[2]
            and (weight is None or (fused.fits(weight) and weight.shape == x.shape[-1:]))):
        return fused.norm_rope_(x, weight, cos, sin, eps)
    return apply_rope(x if weight is None else rms_norm(x, weight, eps), cos, sin)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (Nemotron-H's MLP and experts): relu(x)^2, no gate."""
    return torch.relu(x).square()


def geglu(y: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate | up, one Stacked product) -> gelu_tanh(gate) * up."""
    if fused.fits(y) and y.is_contiguous():
        return fused.geglu(y)
    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate | up, one Stacked product) -> silu(gate) * up."""
    if fused.fits(y) and y.is_contiguous():
        return fused.swiglu(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
