"""Products and conversions on QuantizedWeight, dispatched to the C kernels (kvlab.kernels._qk).

Decode (few rows of x): the C kernel quantizes x to 8-bit blocks once per call and reads
each weight row once for all rows of x, with integer dot products per block, rows split
across the kernel's threads. Prefill (many rows): tiles of W are dequantized to fp32 in C
and multiplied with torch.mm, so it runs near sgemm speed with a bounded fp32 buffer.
Without the extension everything still works through gguf's numpy dequantizer and torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kvlab.kernels.grids import load_grids
from kvlab.kernels.hugepages import weight_buffer
from kvlab.kernels.qweight import QuantizedWeight, row_bytes
from kvlab.layouts import GROUPS_AS

if os.environ.get("KVLAB_EMULATE_512"):  # tests only: AVX-512 kernels emulated on AVX2
    from kvlab.kernels import _qk_emu512 as _qk  # built by `make emu512`
else:
    try:
        from kvlab.kernels import _qk
    except ImportError:  # not built: `pip install -e .` or `python setup.py build_ext --inplace`
        _qk = None
if _qk is not None:
    _qk.set_num_threads(torch.get_num_threads())
    load_grids(_qk)

T = GGMLQuantizationType
TILE_ELEMENTS = 1 << 20  # fp32 elements per dequantized tile (4 MiB)
_C_QUANTIZERS = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
_NUMPY_QUANTIZERS = (T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4)


def kernel_backend() -> str:
    """'avx2' or 'generic' (the C kernels in use), or 'torch' when the extension is absent."""
    return _qk.isa() if _qk is not None else "torch"


def kernel_backend_detail() -> str:
    """kernel_backend(), with ' (AVX512-VNNI paths)' where the AVX2 set takes them on this
    CPU (it does unless KVLAB_NO_VNNI=1), and ', VBMI value planes' where its lattice-type
    decode does too (unless KVLAB_NO_VBMI=1): for reports, so a figure names the code it ran."""
    name = kernel_backend()
    if _qk is None or not _qk.uses_vnni():
        return name
    return name + (" (AVX512-VNNI paths, VBMI value planes)" if _qk.uses_vbmi()
                   else " (AVX512-VNNI paths)")


def set_num_threads(n: int) -> None:
    """Threads for the kernels and for torch's intra-op pool (the same count, so that the
    two never oversubscribe the cores between them)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    if _qk is not None:
        _qk.set_num_threads(n)
    torch.set_num_threads(n)


def stream_read(x: torch.Tensor) -> float:
    """Read every byte of a contiguous CPU tensor on the kernel threads (a bandwidth probe);
    torch.sum where the C extension is not built. Returns a value that depends on them."""
    if _qk is None or not x.is_contiguous() or not x.is_cpu:
        return float(x.sum())
    return float(_qk.stream_read(x.data_ptr(), x.numel() * x.element_size()))


def weight_bytes_read() -> int:
    """Bytes of quantized weights the C products and embedding-row lookups have read since
    the extension loaded (0 without it): the weights a step really touched."""
    return _qk.weight_bytes_read() if _qk is not None else 0


def get_num_threads() -> int:
    return _qk.get_num_threads() if _qk is not None else torch.get_num_threads()


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole matrix as a new [out, in] tensor."""
    out = torch.empty(w.shape, dtype=torch.float32)
    _dequantize_into(w, 0, w.out_features, out, parallel=True)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup: fp32 rows `ids` (any shape) -> [*ids.shape, in]; reads only them."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
    if _qk is not None:
        qt, ptr, rows, cols, nbytes = w.kernel_args
        _qk.dequantize_rows(qt, ptr, rows, cols, nbytes, flat.data_ptr(), flat.numel(),
                            out.data_ptr())
    elif flat.numel():
        if int(flat.min()) < 0 or int(flat.max()) >= w.out_features:
            raise IndexError(f"row ids must be in [0, {w.out_features}), got "
                             f"{int(flat.min())}..{int(flat.max())}")
        out.copy_(_numpy_dequant(w.data[flat], w.qtype))
    return out.view(*ids.shape, w.in_features)


def qmatmul(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T in fp32: x [..., in] -> [..., out].

    Every row, decode or prefill, goes through the integer kernels (x rounded to 8-bit
    blocks): a row's result depends on that row alone, so a sequence gets bit-identical
    logits whether it runs alone, batched with others, in prefill chunks of any size or
    after a prefix-cache hit. `dense_matmul` (fp32 tiles + BLAS) is about 20 % faster for
    long prompts but rounds differently from the decode path. `out` (a contiguous fp32
    [n, out_features], as `scratch.take` gives) receives the result where the C kernels
    compute it."""
    qt, ptr, rows, cols, nbytes = w.kernel_args
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        return _qmatmul_any_layout(x, w)
    n = x.shape[0]
    if x.shape[1] != cols:
        raise ValueError(f"x has {x.shape[1]} features, the weight {w!r} takes {cols}")
    if _qk is None or qt == T.F32:
        return dense_matmul(x, w)
    y = torch.empty(n, rows, dtype=torch.float32) if out is None else out
    _qk.qmatmul(qt, ptr, rows, cols, nbytes, x.data_ptr(), n, y.data_ptr())
    return y


def qmatmul_stacked(x: torch.Tensor, ws: tuple[QuantizedWeight, ...]) -> torch.Tensor:
    """torch.cat([qmatmul(x, w) for w in ws], -1) for weights sharing the input x [1, in]
    (decode): each kernel writes its columns of one output row, no concatenation."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or _qk is None or any(
            w.qtype == T.F32 or w.in_features != x.shape[1] for w in ws):
        return torch.cat([qmatmul(x, w) for w in ws], dim=-1)
    x = x.contiguous()
    y = torch.empty(1, sum(w.out_features for w in ws), dtype=torch.float32)
    ptr = y.data_ptr()
    for w in ws:  # one row: the columns of each part are contiguous
        qt, wptr, rows, cols, nbytes = w.kernel_args
        _qk.qmatmul(qt, wptr, rows, cols, nbytes, x.data_ptr(), 1, ptr)
        ptr += rows * 4
    return y


def _qmatmul_any_layout(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {w!r} takes "
                         f"{w.in_features}")
    x2 = x.reshape(-1, w.in_features).to(torch.float32).contiguous()
    return qmatmul(x2, w).view(*x.shape[:-1], w.out_features)


def quantize(t: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """fp32 [out, in] -> QuantizedWeight of `qtype` (a new buffer).

    Q8_0 is byte-identical to gguf.quants.quantize; Q4_K/Q5_K/Q6_K use kvlab's own
    least-squares search (C); Q4_0/Q4_1/Q5_0/Q5_1/MXFP4/F16/BF16 go through gguf's quantizer.
    """
    qtype = T(qtype)
    if t.dim() != 2:
        raise ValueError(f"quantize takes a matrix [out, in], got shape {tuple(t.shape)}")
    rows, cols = t.shape
    nbytes = row_bytes(qtype, cols)
    src = t.detach().to(torch.float32).contiguous()
    if qtype in _C_QUANTIZERS and _qk is not None:
        data = torch.empty(rows, nbytes, dtype=torch.uint8)
        _qk.quantize(int(qtype), src.data_ptr(), rows, cols, data.data_ptr())
    elif qtype == T.F32:
        data = src.view(torch.uint8).view(rows, nbytes).clone()
    elif qtype in _NUMPY_QUANTIZERS:
        data = torch.from_numpy(np.ascontiguousarray(
            gguf_quants.quantize(src.numpy(), qtype)).view(np.uint8).reshape(rows, nbytes))
    elif qtype in _C_QUANTIZERS:
        raise RuntimeError(f"quantizing to {qtype.name} needs kvlab's C extension; build it "
                           "with `pip install -e .` (or pick Q8_0, Q4_0, Q5_0, ...)")
    else:  # e.g. Q2_K, Q3_K, IQ4_XS: read from GGUF files, not produced here
        names = ", ".join(t.name for t in (T.F32, *_NUMPY_QUANTIZERS, *_C_QUANTIZERS[1:]))
        raise ValueError(f"kvlab has no quantizer for {qtype.name} (it reads {qtype.name} "
                         f"weights from GGUF files); quantize to one of {names}")
    return QuantizedWeight(qtype, (rows, cols), data)


# GGUF type -> the type of its 8-row groups (Q4_0 widens to Q8_0 exactly)


def can_group(w: QuantizedWeight) -> bool:
    """Whether `group_rows` applies: C kernels built, a matrix of 8k rows of a type in
    GROUPS_AS."""
    return (_qk is not None and not w.grouped and w.qtype in GROUPS_AS
            and w.out_features % 8 == 0)


GROUP_CHUNK_ROWS = 8192  # rows grouped per call: the source's pages can go as they are read


def group_rows(w: QuantizedWeight,
               read: Callable[[int, int], None] | None = None) -> QuantizedWeight:
    """w in interleaved groups of 8 rows (a new buffer) with the same values exactly: Q8_0,
    Q4_0 as Q8_0x8 (Q8_0's size), and Q5_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, IQ4_NL and
    MXFP4 as Q5_0x8, Q4_Kx8, ... (each its own type's size). Their products serve 8
    rows per register: batched decode and prefill run 1.3-2x faster (csrc/qk_group8_*.c).
    `read(start, end)` is told each span of w's bytes once it has been grouped (a loader
    drops those file pages then)."""
    if not can_group(w):
        names = ", ".join(t.name for t in GROUPS_AS)
        raise ValueError(f"{w!r} cannot be grouped: that takes the C kernels and {names} "
                         "rows in a multiple of 8")
    rows, cols = w.shape
    qtype = GROUPS_AS[w.qtype]
    dst_bytes = row_bytes(qtype, cols, grouped=True)
    data = weight_buffer(rows * dst_bytes).view(rows, dst_bytes)
    qt, ptr, _, _, src_bytes = w.kernel_args
    for r0 in range(0, rows, GROUP_CHUNK_ROWS):
        n = min(GROUP_CHUNK_ROWS, rows - r0)  # a multiple of 8, as rows is
        _qk.to_x8(qt, ptr + r0 * src_bytes, n, cols, src_bytes,
                  data.data_ptr() + r0 * dst_bytes)
        if read is not None:
            read(r0 * src_bytes, (r0 + n) * src_bytes)
    return QuantizedWeight(qtype, (rows, cols), data, grouped=True)


def _dequantize_into(w: QuantizedWeight, r0: int, r1: int, out: torch.Tensor,
                     parallel: bool = False) -> None:
    """Rows [r0, r1) of w -> out (contiguous fp32 [r1 - r0, in]); `parallel` uses the
    kernel threads, else the calling thread alone (between BLAS calls, see dense_matmul)."""
    if _qk is not None:
        qt, ptr, _, cols, nbytes = w.kernel_args
        _qk.dequantize(qt, ptr + r0 * nbytes, r1 - r0, cols, nbytes, out.data_ptr(), parallel)
    else:
        out.copy_(_numpy_dequant(w.data[r0:r1], w.qtype))


def _numpy_dequant(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(blocks.numpy(), qtype))


def dense_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x @ W^T with BLAS: directly for F32, else through fp32 tiles of W of at most
    TILE_ELEMENTS elements, dequantized in C (or by gguf's numpy code without it)."""
    if w.qtype == T.F32:
        return x @ w.data.view(torch.float32).t()
    rows, cols = w.shape
    n_tiles = max(1, -(-rows * cols // TILE_ELEMENTS))
    tile_rows = max(1, -(-rows // n_tiles))  # equal tiles: a small last one runs BLAS poorly
    if w.grouped:  # tiles start on a group of 8 rows
        tile_rows = -(-tile_rows // 8) * 8
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    buf = torch.empty(tile_rows, cols, dtype=torch.float32)
    for r0 in range(0, rows, tile_rows):
        r1 = min(rows, r0 + tile_rows)
        tile = buf[: r1 - r0]
        _dequantize_into(w, r0, r1, tile)
        torch.mm(x, tile.t(), out=y[:, r0:r1])
    return y
