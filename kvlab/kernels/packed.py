"""PackedWeight: GGUF blocks rearranged for GPU kernels, the same bits in separate planes.

A GGUF block interleaves its scales with its quants (Q4_K: d, dmin, 12 bytes of 6-bit
scales and mins, then 128 bytes of nibbles), so a warp reading many rows' blocks strides
over bytes it does not want yet. `pack` splits each block into planes of one field each,
row-major [out_features, ...], so that a kernel reads the quants of a tile of rows as
contiguous runs and their scales from a small plane of their own. Values are bit-exact: the
planes hold the stored bits (the 6-bit K-quant scales unpacked to one byte each, which is
the only growth), and kvlab.gpu.quant_matmul dequantizes them in registers.

    type     planes (each [out, ...] for a weight [out, in])                   bytes / file
    Q8_0     qs int8 [in], d f16 [in/32]                                       1.000
    Q4_K     qs u8 [in/2], scales u8 [in/32], mins u8 [in/32], d, dmin f16     1.028
    Q5_K     qs u8 [in/2], qh u8 [in/8], scales, mins u8 [in/32], d, dmin      1.023
    Q6_K     ql u8 [in/2], qh u8 [in/4], scales i8 [in/16], d f16 [in/256]     1.000
    IQ4_XS   qs u8 [in/2], scales i8 [in/32] (stored - 32), d f16 [in/256]     1.015
    MXFP4    qs u8 [in/2], e u8 [in/32] (E8M0 exponents)                       1.000
    Q4_0     qs u8 [in/2], d f16 [in/32]                                       1.000
    Q5_0     qs u8 [in/2], qh u8 [in/8], d f16 [in/32]                         1.000

Quant planes keep the file's byte order within a block (Q4_K: byte 32j + l holds elements
64j + l and 64j + 32 + l), which the kernels index directly. Planes of rows concatenate
(q|k|v, gate|up), so stacking packed weights is a row concatenation of each plane.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.kernels.qweight import QuantizedWeight

T = GGMLQuantizationType
PACKED_TYPES: tuple[GGMLQuantizationType, ...] = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS,
                                                  T.MXFP4, T.Q4_0, T.Q5_0)
# the 16 values a 4-bit index selects (gguf's IQ4_NL table; MXFP4's E2M1 values doubled)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """[out_features, in_features] matrix of `qtype` blocks as planes on one device;
    products return `dtype` (the model's compute dtype), as a dense weight of it would."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (out_features, in_features)
    planes: tuple[torch.Tensor, ...]  # each [out_features, ...], contiguous
    dtype: torch.dtype
    values: torch.Tensor | None = None  # fp32 [16]: IQ4_XS's or MXFP4's value table

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def is_cuda(self) -> bool:
        return self.planes[0].is_cuda

    @property
    def nbytes(self) -> int:
        """Bytes resident on the device (the value table aside)."""
        return sum(p.numel() * p.element_size() for p in self.planes)

    @property
    def file_nbytes(self) -> int:
        """Bytes the same matrix takes in GGUF blocks."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[0] * self.shape[1] // block * size

    def to(self, device: torch.device | str) -> PackedWeight:
        values = None if self.values is None else self.values.to(device)
        return PackedWeight(self.qtype, self.shape, tuple(p.to(device) for p in self.planes),
                            self.dtype, values)

    def __repr__(self) -> str:
        return (f"PackedWeight({self.qtype.name}, {self.shape[0]}x{self.shape[1]}, "
                f"{self.nbytes} bytes, {self.device})")


def pack(w: QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> PackedWeight:
    """w's blocks as planes on `device` (the split runs there: the file's bytes are copied
    over once, then rearranged by the device)."""
    if w.qtype not in PACKED_TYPES or w.grouped:
        names = ", ".join(t.name for t in PACKED_TYPES)
        raise ValueError(f"{w!r} cannot be packed: the packed types are {names} (ungrouped)")
    rows, cols = w.shape
    block, size = GGML_QUANT_SIZES[w.qtype]
    blocks = w.data.to(device).view(rows, cols // block, size)
    planes = _SPLIT[w.qtype](blocks)
    values = {T.IQ4_XS: IQ4_VALUES, T.MXFP4: MXFP4_VALUES}.get(w.qtype)
    table = None if values is None else torch.tensor(values, dtype=torch.float32, device=device)
    return PackedWeight(w.qtype, (rows, cols), tuple(p.reshape(rows, -1).contiguous()
                                                     for p in planes), dtype, table)


def concat_rows(a: PackedWeight, b: PackedWeight) -> PackedWeight:
    """The rows of a, then those of b (same type, width and dtype)."""
    if (a.qtype, a.shape[1], a.dtype) != (b.qtype, b.shape[1], b.dtype):
        raise ValueError(f"cannot stack {a!r} and {b!r}: type, width and dtype must match")
    planes = tuple(torch.cat([p, q]) for p, q in zip(a.planes, b.planes))
    return PackedWeight(a.qtype, (a.shape[0] + b.shape[0], a.shape[1]), planes, a.dtype,
                        a.values)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] fp16 of the same bits (little-endian, as GGUF stores them)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] each (as
    ggml's get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], -1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return scales, mins


def _split_q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[..., 2:].contiguous().view(torch.int8), _f16(b[..., 0:2])


def _split_q4_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales, mins = _k4_scales(b[..., 4:16])
    return b[..., 16:144], scales, mins, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _split_q5_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales, mins = _k4_scales(b[..., 4:16])
    return b[..., 48:176], b[..., 16:48], scales, mins, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _split_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (b[..., 0:128], b[..., 128:192], b[..., 192:208].contiguous().view(torch.int8),
            _f16(b[..., 208:210]))


def _split_iq4_xs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_XS sub-block s's scale: 4 low bits in scales_l[s / 2], 2 high in scales_h."""
    high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)  # [..., ] u16
    low = torch.stack([b[..., 4:8] & 0xF, b[..., 4:8] >> 4], -1).flatten(-2).to(torch.int32)
    shifts = 2 * torch.arange(8, device=b.device, dtype=torch.int32)
    scales = low | (((high[..., None] >> shifts) & 3) << 4)
    return b[..., 8:136], (scales - 32).to(torch.int8), _f16(b[..., 0:2])


def _split_mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[..., 1:17], b[..., 0]


def _split_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[..., 2:18], _f16(b[..., 0:2])


def _split_q5_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[..., 6:22], b[..., 2:6], _f16(b[..., 0:2])


_SPLIT = {T.Q8_0: _split_q8_0, T.Q4_K: _split_q4_k, T.Q5_K: _split_q5_k, T.Q6_K: _split_q6_k,
          T.IQ4_XS: _split_iq4_xs, T.MXFP4: _split_mxfp4, T.Q4_0: _split_q4_0,
          T.Q5_0: _split_q5_0}
