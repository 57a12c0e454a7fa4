"""Products with packed GGUF weights (kvlab.kernels.packed) on CUDA, in Triton.

Hand-written because no library kvlab depends on multiplies GGUF's blocks (Q8_0, Q4_0,
Q5_0, the K-quants, IQ4_XS, MXFP4) on a GPU while they stay quantized: torch and cuBLAS take
dense matrices only, so the old path dequantized every weight to bf16 at load (3.6x the
bytes of Q4_K, and as many more bytes read per decoded token). Here the weight stays in its
blocks and each kernel dequantizes a tile of [rows, 32] in registers (`_w_tile`, the one
place that knows the formats), with the C dequantizers' arithmetic order, so values are
bit-identical to kvlab.kernels.dequantize.

    gemv  (decode, <= GEMV_MAX_ROWS rows of x): a program per BLOCK_N weight rows (and per
          part of the row, where few rows would leave SMs idle) reads each of their blocks
          once and serves every row of x from registers
    gemm  (prefill): [BLOCK_M, BLOCK_N] output tiles, tl.dot over 32-wide steps of K with
          the weight tile cast to x's dtype (bf16/fp16 tensor cores; fp32 in IEEE)
    dequantize_rows: rows of the weight as a dense tensor (embedding lookups, tests)

Accumulation is fp32 throughout (the products with fused multiply-adds, the row lookup
without); outputs take the weight's compute dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from kvlab.kernels.packed import PackedWeight

T = GGMLQuantizationType
# constexpr codes of the formats, one branch each in _w_tile
_CODES = {T.Q8_0: 0, T.Q4_K: 1, T.Q5_K: 2, T.Q6_K: 3, T.IQ4_XS: 4, T.MXFP4: 5, T.Q4_0: 6,
          T.Q5_0: 7}
GEMV_MAX_ROWS = 8  # more rows of x than this go through the tiled GEMM
# Triton's CPU interpreter (TRITON_INTERPRET=1, the tests without a GPU) multiplies bf16
# tiles as their uint16 bits in tl.dot: there the GEMM widens half tiles to fp32 first
_INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def _k4_scaled(q, sc_ptr, mn_ptr, d_ptr, dm_ptr, rows, kk, K):
    """Q4_K/Q5_K: (d * scale) * q - (dmin * min) for sub-block kk / 32 of each row."""
    sub = rows * (K // 32) + kk // 32
    blk = rows * (K // 256) + kk // 256
    d1 = tl.load(d_ptr + blk).to(tl.float32) * tl.load(sc_ptr + sub).to(tl.float32)
    m1 = tl.load(dm_ptr + blk).to(tl.float32) * tl.load(mn_ptr + sub).to(tl.float32)
    return d1[:, None] * q.to(tl.float32) - m1[:, None]


@triton.jit
def _w_tile(QT: tl.constexpr, p0, p1, p2, p3, p4, p5, lut, rows, kk, K):
    """fp32 [BLOCK_N, 32]: elements kk..kk+31 of weight rows `rows` (int64, in range)."""
    c = tl.arange(0, 32)
    r = rows[:, None]
    if QT == 0:  # Q8_0: qs * d
        q = tl.load(p0 + r * K + kk + c[None, :]).to(tl.float32)
        d = tl.load(p1 + rows * (K // 32) + kk // 32).to(tl.float32)
        w = q * d[:, None]
    elif QT == 1 or QT == 2:  # Q4_K, Q5_K: byte 32j + l holds elements 64j + l, 64j + 32 + l
        j = (kk % 256) // 64
        half = (kk // 32) % 2
        base = (kk // 256) * 128 + j * 32
        q = (tl.load(p0 + r * (K // 2) + base + c[None, :]).to(tl.int32) >> (4 * half)) & 0xF
        if QT == 1:
            w = _k4_scaled(q, p1, p2, p3, p4, rows, kk, K)
        else:  # the fifth bit: bit 2j + half of qh[l]
            qh = tl.load(p1 + r * (K // 8) + (kk // 256) * 32 + c[None, :]).to(tl.int32)
            q = q | (((qh >> (2 * j + half)) & 1) << 4)
            w = _k4_scaled(q, p2, p3, p4, p5, rows, kk, K)
    elif QT == 3:  # Q6_K: element 128h + 32g + l; 4 bits from ql, 2 from qh, a scale per 16
        e = kk % 256
        h = e // 128
        g = (e % 128) // 32
        sb = kk // 256
        lo = tl.load(p0 + r * (K // 2) + sb * 128 + 64 * h + 32 * (g % 2) + c[None, :])
        hi = tl.load(p1 + r * (K // 4) + sb * 64 + 32 * h + c[None, :])
        q = ((lo.to(tl.int32) >> (4 * (g // 2))) & 0xF) | (((hi.to(tl.int32) >> (2 * g)) & 3) << 4)
        sc = tl.load(p2 + r * (K // 16) + sb * 16 + 8 * h + 2 * g + c[None, :] // 16)
        d = tl.load(p3 + rows * (K // 256) + sb).to(tl.float32)
        w = (d[:, None] * sc.to(tl.float32)) * (q - 32).to(tl.float32)
    else:  # 16 bytes per 32 elements: element l in the low nibble of byte l, l + 16 in the high
        sub = kk // 32
        byte = tl.load(p0 + r * (K // 2) + sub * 16 + (c[None, :] % 16)).to(tl.int32)
        q = (byte >> (4 * (c[None, :] // 16))) & 0xF
        if QT == 4:  # IQ4_XS: (d * (scale - 32)) * v[q]
            ls = tl.load(p1 + rows * (K // 32) + sub).to(tl.float32)
            d = tl.load(p2 + rows * (K // 256) + kk // 256).to(tl.float32)
            w = (d * ls)[:, None] * tl.load(lut + q)
        elif QT == 5:  # MXFP4: 2^(e - 128) * v[q], the scale built from its bits
            ex = tl.load(p1 + rows * (K // 32) + sub).to(tl.int32)
            bits = tl.where(ex < 2, 0x00200000 << ex, (ex - 1) << 23)  # subnormal for e < 2
            w = bits.to(tl.float32, bitcast=True)[:, None] * tl.load(lut + q)
        elif QT == 6:  # Q4_0: d * (q - 8)
            d = tl.load(p1 + rows * (K // 32) + sub).to(tl.float32)
            w = d[:, None] * (q - 8).to(tl.float32)
        else:  # Q5_0: d * (q - 16), the fifth bit of element l is bit l of the block's qh
            qh = tl.load(p1 + r * (K // 8) + sub * 4 + c[None, :] // 8).to(tl.int32)
            q = q | (((qh >> (c[None, :] % 8)) & 1) << 4)
            d = tl.load(p2 + rows * (K // 32) + sub).to(tl.float32)
            w = d[:, None] * (q - 16).to(tl.float32)
    return w


@triton.jit
def _dequant_kernel(ids_ptr, out_ptr, n, K, p0, p1, p2, p3, p4, p5, lut,
                    QT: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[i, kk:kk+32] = row ids[i] of the weight; grid (n / BLOCK_N, K / 32)."""
    i, ok, _ = _span(tl.program_id(0), BLOCK_N, n)
    rows = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int64)
    kk = tl.program_id(1) * 32
    w = _w_tile(QT, p0, p1, p2, p3, p4, p5, lut, rows, kk, K)
    c = tl.arange(0, 32)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * K + kk + c[None, :], w, mask=ok[:, None])


@triton.jit
def _span(pid, BLOCK: tl.constexpr, N):
    """Indices pid * BLOCK + [0, BLOCK), which are < N, and them as int64 with those past
    N clamped to 0 (read, so that loads need no mask, never stored)."""
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    return i, ok, tl.where(ok, i, 0).to(tl.int64)


@triton.jit
def _store(y_ptr, acc, m, n, m_ok, n_ok, N):
    """The fp32 tile acc -> y[m, n] (contiguous [M, N]) in y's dtype, in range only."""
    out = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, M, N, K, K_CHUNK, p0, p1, p2, p3, p4, p5, lut,
                 QT: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr,
                 STEPS: tl.constexpr):
    """y[split, m, n] = sum over the split's K_CHUNK columns of x[m, k] w[n, k], for the M
    (<= M_PAD) rows of x; grid (N / BLOCK_N, K / K_CHUNK). x [M, K] contiguous, y
    [splits, M, N]; STEPS 32-wide sub-blocks per loop trip (independent loads in flight)."""
    n, n_ok, rows = _span(tl.program_id(0), BLOCK_N, N)
    m, m_ok, _ = _span(0, M_PAD, M)
    c = tl.arange(0, 32)
    # per-lane partial sums, reduced across the 32 lanes once at the end, not every step
    acc = tl.zeros([M_PAD, BLOCK_N, 32], dtype=tl.float32)
    k_start = tl.program_id(1) * K_CHUNK
    for k0 in range(k_start, tl.minimum(k_start + K_CHUNK, K), 32 * STEPS):
        for s in tl.static_range(STEPS):
            kk = k0 + 32 * s
            w = _w_tile(QT, p0, p1, p2, p3, p4, p5, lut, rows, kk, K)
            x = tl.load(x_ptr + m[:, None] * K + kk + c[None, :], mask=m_ok[:, None], other=0.0)
            acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    _store(y_ptr + tl.program_id(1) * M * N, tl.sum(acc, axis=2), m, n, m_ok, n_ok, N)


@triton.jit
def _gemm_kernel(x_ptr, y_ptr, M, N, K, p0, p1, p2, p3, p4, p5, lut,
                 QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 STEPS: tl.constexpr, WIDEN: tl.constexpr):
    """y = x @ w^T by [BLOCK_M, BLOCK_N] tiles; grid (M / BLOCK_M, N / BLOCK_N): programs
    next to each other share a tile of weight rows, which then leaves DRAM once (x, the
    smaller operand up to long prompts, is the one re-read). WIDEN: fp16/bf16 tiles are
    multiplied as the fp32 numbers they hold (the same products)."""
    m, m_ok, xrows = _span(tl.program_id(0), BLOCK_M, M)
    n, n_ok, rows = _span(tl.program_id(1), BLOCK_N, N)
    c = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 32 * STEPS):
        for s in tl.static_range(STEPS):
            kk = k0 + 32 * s
            w = _w_tile(QT, p0, p1, p2, p3, p4, p5, lut, rows, kk, K)
            x = tl.load(x_ptr + xrows[:, None] * K + kk + c[None, :])
            if x_ptr.dtype.element_ty == tl.float32:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            elif WIDEN:
                wt = w.to(x_ptr.dtype.element_ty).to(tl.float32)
                acc = tl.dot(x.to(tl.float32), tl.trans(wt), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    _store(y_ptr, acc, m, n, m_ok, n_ok, N)


def _operands(w: PackedWeight) -> list:
    """The six plane pointers (unused ones repeat the first) and the value table."""
    planes = list(w.planes) + [w.planes[0]] * (6 - len(w.planes))
    return [*planes, w.planes[0] if w.values is None else w.values]


def _steps(w: PackedWeight, most: int) -> int:
    """32-wide sub-blocks per loop trip: as many as divide the row, up to `most`."""
    subs = w.shape[1] // 32
    return next(s for s in (8, 4, 2, 1) if s <= most and subs % s == 0)


def dequantize_rows(w: PackedWeight, ids: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape, each in [0, out): unchecked, a check would wait for the
    device) of w -> [*ids.shape, in] in `dtype`; reads only those rows."""
    flat = ids.reshape(-1).to(device=w.device, dtype=torch.int64).contiguous()
    out = torch.empty(flat.numel(), w.shape[1], dtype=dtype, device=w.device)
    if flat.numel():
        block = 32
        grid = (triton.cdiv(flat.numel(), block), w.shape[1] // 32)
        # no fused multiply-adds: (d * scale) * q - (dmin * min) rounds as the C code does
        _dequant_kernel[grid](flat, out, flat.numel(), w.shape[1], *_operands(w),
                              QT=_CODES[w.qtype], BLOCK_N=block, enable_fp_fusion=False)
    return out.view(*ids.shape, w.shape[1])


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole matrix [out, in] in `dtype`."""
    return dequantize_rows(w, torch.arange(w.shape[0], device=w.device), dtype)


def linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out] in w.dtype, x taken in w.dtype (as F.linear with a
    dense weight of that dtype)."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {w!r} takes "
                         f"{w.shape[1]}")
    x2 = x.reshape(-1, w.shape[1]).to(w.dtype).contiguous()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=w.dtype, device=x.device)
    if x2.shape[0] <= GEMV_MAX_ROWS:
        gemv(x2, w, y)
    else:
        gemm(x2, w, y)
    return y.view(*x.shape[:-1], w.shape[0])


def gemv(x: torch.Tensor, w: PackedWeight, y: torch.Tensor, splits: int | None = None) -> None:
    """y [M, out] = x [M, in] @ w^T for a few rows (M <= GEMV_MAX_ROWS); contiguous.

    `splits` parts of each row run in programs of their own (None: enough for every SM
    to hold two programs), their partial sums added in a fixed order: the result does not
    depend on scheduling."""
    m, (n, k) = x.shape[0], w.shape
    if not m:
        return
    block, steps = 32, _steps(w, 8)
    programs = triton.cdiv(n, block)
    if splits is None:
        splits = max(1, min(8, 2 * _multiprocessors(x.device) // programs))
    chunk = triton.cdiv(triton.cdiv(k, 32 * steps), splits) * 32 * steps
    splits = triton.cdiv(k, chunk)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=y.device)
    _gemv_kernel[(programs, splits)](
        x, out, m, n, k, chunk, *_operands(w), QT=_CODES[w.qtype], BLOCK_N=block,
        M_PAD=triton.next_power_of_2(m), STEPS=steps, num_warps=4 if m <= 2 else 8,
        enable_fp_fusion=True)
    if splits > 1:
        torch.sum(out, 0, out=y) if y.dtype == torch.float32 else y.copy_(out.sum(0))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm(x: torch.Tensor, w: PackedWeight, y: torch.Tensor) -> None:
    """y [M, out] = x [M, in] @ w^T by tiles (prefill); contiguous.

    Tiles that sm_90 holds in registers without spilling (ptxas, every packed type): half
    activations 16x64 or 32x64 with 4 warps for short runs of rows, 128x128 with 8 warps
    past them; fp32 ones (IEEE dots, twice the registers) 16x64."""
    m = x.shape[0]
    if x.dtype == torch.float32 or m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 32:
        block_m, block_n, warps = 32, 64, 4
    else:
        block_m, block_n, warps = 128, 128, 8
    grid = (triton.cdiv(m, block_m), triton.cdiv(w.shape[0], block_n))
    _gemm_kernel[grid](x, y, m, w.shape[0], w.shape[1], *_operands(w),
                       QT=_CODES[w.qtype], BLOCK_M=block_m, BLOCK_N=block_n, STEPS=1,
                       WIDEN=_INTERPRETED and x.dtype != torch.float32, num_warps=warps,
                       enable_fp_fusion=True)
