"""Quantized weights and their products: GGUF blocks kept as stored, read by C kernels.

    QuantizedWeight(qtype, (out, in), data)      frozen; data uint8 [out, row_bytes]
    QuantizedWeight.from_gguf(file, name)        zero-copy from the memory map
    dequantize(w, dtype) -> [out, in]             all supported types
    dequantize_rows(w, ids) -> [*ids, in] fp32    embedding lookup, reads only those rows
    qmatmul(x, w) -> x @ W^T fp32                 decode: int8 kernels; prefill: fp32 tiles
    qmatmul_stacked(x, ws) -> [1, sum(out)]       one decode row through several weights
    quantize(t, qtype) -> QuantizedWeight         Q8_0 (byte-exact), Q4_K, Q5_K, Q6_K, ...
    group_rows(w) -> QuantizedWeight              8-row groups: Q8_0x8, Q4_Kx8, Q6_Kx8, IQ4_XSx8, ...
    set_num_threads(n)                            kernel threads and torch's, together
    stream_read(t)                                read all of t on the kernel threads
    weight_bytes_read() -> int                    weight bytes the C kernels have read so far

Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL,
IQ4_XS, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (Q2_K, Q3_K and the IQ types are read
from GGUF files; kvlab does not quantize to them; MXFP4, gpt-oss's expert type, runs IQ4_NL's
kernels on its own table and scales; the IQ2/IQ3 grids come from the gguf package, grids.py).
"""

from kvlab.kernels.ops import (
    can_group,
    dequantize,
    dequantize_rows,
    get_num_threads,
    group_rows,
    kernel_backend,
    kernel_backend_detail,
    qmatmul,
    qmatmul_stacked,
    quantize,
    set_num_threads,
    stream_read,
    weight_bytes_read,
)
from kvlab.kernels.qweight import SUPPORTED_TYPES, QuantizedWeight

__all__ = [
    "SUPPORTED_TYPES",
    "QuantizedWeight",
    "can_group",
    "dequantize",
    "dequantize_rows",
    "get_num_threads",
    "group_rows",
    "kernel_backend",
    "kernel_backend_detail",
    "qmatmul",
    "qmatmul_stacked",
    "quantize",
    "set_num_threads",
    "stream_read",
    "weight_bytes_read",
]
