"""QuantizedWeight: a weight matrix kept in its GGUF block format, bytes unchanged.

`data` is a uint8 tensor [out_features, row_bytes]; from a GGUF file it is a zero-copy view
of the memory map, so a 4-bit model costs 4 bits per weight in RAM and in every product.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.layouts import GROUPED_BLOCK_BYTES, GROUPED_KERNEL_TYPES
from kvlab.weights.gguf_file import GGUFFile

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
    T.Q2_K,
    T.Q3_K,
    T.IQ4_NL,
    T.IQ4_XS,
    T.MXFP4,
    T.IQ2_XXS,
    T.IQ2_XS,
    T.IQ2_S,
    T.IQ3_XXS,
    T.IQ3_S,
)


def row_bytes(qtype: GGMLQuantizationType, in_features: int, grouped: bool = False) -> int:
    """Bytes of one row of `in_features` elements (on average, for 8-row groups); checks
    the row is whole blocks."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"weight type {qtype.name} is not supported (valid: {names})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if in_features <= 0 or in_features % block:
        raise ValueError(f"{qtype.name} rows must be a positive multiple of {block} elements, "
                         f"got {in_features}")
    return in_features // block * (GROUPED_BLOCK_BYTES[qtype] if grouped else type_size)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """[out_features, in_features] matrix in GGUF blocks; compare by identity."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (out_features, in_features), PyTorch order
    data: torch.Tensor  # uint8 [out_features, row_bytes]: the GGUF blocks, unchanged
    # rows interleaved in groups of 8 (kvlab's Q8_0x8, Q4_Kx8 etc. for the types in
    # GROUPED_KERNEL_TYPES, kernels/csrc/qk_group8_*.c), for products that serve 8 rows per
    # register
    grouped: bool = False
    # (type id, address, rows, cols, row_bytes): what every C call takes, computed once
    kernel_args: tuple[int, int, int, int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        qtype = GGMLQuantizationType(self.qtype)
        if len(self.shape) != 2:
            raise ValueError(f"a QuantizedWeight is a matrix, got shape {tuple(self.shape)}")
        rows, cols = (int(s) for s in self.shape)
        if self.grouped and (qtype not in GROUPED_KERNEL_TYPES or rows % 8):
            names = ", ".join(t.name for t in GROUPED_KERNEL_TYPES)
            raise ValueError(f"grouped rows are {names} in groups of 8, got "
                             f"{qtype.name} with {rows} rows")
        nbytes = row_bytes(qtype, cols, self.grouped)
        data = self.data
        if data.dtype != torch.uint8 or data.numel() != rows * nbytes:
            raise ValueError(f"{qtype.name} {rows}x{cols} needs uint8 data of {rows}x{nbytes} "
                             f"bytes, got {data.dtype} {tuple(data.shape)}")
        data = data.reshape(rows, nbytes)
        if not data.is_contiguous():  # e.g. rows permuted at load time: one copy, here
            data = data.contiguous()
        object.__setattr__(self, "qtype", qtype)
        object.__setattr__(self, "shape", (rows, cols))
        object.__setattr__(self, "data", data)
        kernel_type = GROUPED_KERNEL_TYPES[qtype] if self.grouped else int(qtype)
        object.__setattr__(self, "kernel_args", (kernel_type, data.data_ptr(), rows, cols, nbytes))

    @classmethod
    def from_gguf(cls, file: GGUFFile, name: str) -> QuantizedWeight:
        """Zero-copy view of tensor `name`; tensors of more than 2 dims flatten to rows."""
        try:
            info = file.tensors[name]
        except KeyError:
            raise KeyError(f"{file.path} has no tensor {name!r}") from None
        shape = info.shape if len(info.shape) > 1 else (1, *info.shape)
        rows = math.prod(shape[:-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the mmap is read-only; never written
            data = torch.frombuffer(file.raw(name), dtype=torch.uint8)
        return cls(info.qtype, (rows, shape[-1]), data.view(rows, -1))

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def type_name(self) -> str:
        """"Q4_K", or "Q4_Kx8" for 8-row groups: the layout in memory."""
        return f"{self.qtype.name}x8" if self.grouped else self.qtype.name

    @property
    def nbytes(self) -> int:
        """Bytes a full product reads: the stored blocks."""
        return self.data.numel()

    def __reduce__(self) -> tuple:
        """Copies and pickles rebuild through __init__, so kernel_args gets the new address."""
        return (QuantizedWeight, (self.qtype, self.shape, self.data, self.grouped))

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.type_name}, {self.shape[0]}x{self.shape[1]}, "
                f"{self.nbytes} bytes)")
