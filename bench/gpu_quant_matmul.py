"""Packed GGUF products on CUDA (kvlab.gpu.quant_matmul) against bf16 F.linear on the
dequantized weight: time per product, the weight bytes each one reads, and the bandwidth
that makes (GB/s, against the copy bandwidth measured here), for decode batches (GEMV) and
a prefill (GEMM), on Llama-3.1-8B's matrix shapes in each packed type.

    python3 bench/gpu_quant_matmul.py                    # on a CUDA machine, about a minute
    TRITON_INTERPRET=1 python bench/gpu_quant_matmul.py --device cpu --shapes 64x256 \\
        --batches 1 --prefill 16 --repeats 1             # the code path, under the interpreter
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.gpu import quant_matmul
from kvlab.kernels import QuantizedWeight, dequantize
from kvlab.kernels.packed import PACKED_TYPES, pack

T = GGMLQuantizationType
SHAPES = ("4096x4096", "14336x4096", "4096x14336", "128256x4096")  # q/o, gate/up, down, head


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs, after one warm-up (compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of 1 GiB (4 MiB off CUDA)."""
    n = (1 << 30) if device.type == "cuda" else (4 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), device, repeats)


# where each block's fp16 scales sit (MXFP4: its exponent byte)
SCALES = {T.Q8_0: (0, 2), T.Q4_0: (0, 2), T.Q5_0: (0, 2), T.Q4_K: (0, 4), T.Q5_K: (0, 4),
          T.Q6_K: (208, 210), T.IQ4_XS: (0, 2)}


def weight(qtype: GGMLQuantizationType, rows: int, cols: int) -> QuantizedWeight:
    """Random blocks of `qtype` with small scales: any bytes are valid quants, and the speed
    of a product does not depend on the values (quantizing 8B-model matrices would take
    longer than the products)."""
    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(rows + cols)
    blocks = torch.randint(0, 256, (rows * cols // block, size), dtype=torch.uint8, generator=g)
    if qtype == T.MXFP4:
        blocks[:, 0] = 120  # 2^-8
    else:
        a, b = SCALES[qtype]
        blocks[:, a:b] = torch.full((1, (b - a) // 2), 1e-3, dtype=torch.float16).view(torch.uint8)
    return QuantizedWeight(qtype, (rows, cols), blocks.view(rows, -1))


def row(label: str, seconds: float, nbytes: int, peak: float, dense_s: float) -> str:
    return (f"  {label:<12} {seconds * 1e6:9.1f} us  {nbytes / seconds / 1e9:8.1f} GB/s "
            f"({nbytes / seconds / peak:5.1%} of copy)  bf16 F.linear {dense_s * 1e6:9.1f} us"
            f"  -> {dense_s / seconds:4.2f}x")


def bench_shape(qtype, rows: int, cols: int, device, args, peak: float) -> None:
    q = weight(qtype, rows, cols)
    p = pack(q, torch.bfloat16, device)
    dense = dequantize(q).to(device=device, dtype=torch.bfloat16)
    print(f"{q.qtype.name} {rows}x{cols}: packed {p.nbytes / 2**20:.1f} MiB, "
          f"file {p.file_nbytes / 2**20:.1f} MiB, bf16 {dense.numel() * 2 / 2**20:.1f} MiB")
    for n in [*args.batches, args.prefill]:
        x = torch.randn(n, cols, device=device, dtype=torch.bfloat16)
        s = timed(lambda x=x: quant_matmul.linear(x, p), device, args.repeats)
        d = timed(lambda x=x: F.linear(x, dense), device, args.repeats)
        kind = "gemv" if n <= quant_matmul.GEMV_MAX_ROWS else "gemm"
        print(row(f"{kind} x{n}", s, p.nbytes, peak, d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="ROWSxCOLS")
    ap.add_argument("--types", nargs="+", default=[t.name for t in PACKED_TYPES])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    peak = copy_bandwidth(device, args.repeats)
    print(f"{device}: copy bandwidth {peak / 1e9:.0f} GB/s (read + write)")
    for name in args.types:
        for shape in args.shapes:
            rows, cols = (int(v) for v in shape.split("x"))
            bench_shape(T[name], rows, cols, device, args, peak)


if __name__ == "__main__":
    main()
