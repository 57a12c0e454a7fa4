"""The recurrent-layer kernels (kvlab.kernels.recurrent) at hybrid models' real shapes.

    python bench/recurrent_kernels.py [--threads N] [--prefill 512] [--batch 1,8] [--torch]

For each op, a prefill of one sequence of --prefill tokens and a decode step of each --batch
(one token per sequence, each with its own state slot), at Qwen3.5-2B-like shapes (Gated
DeltaNet: Hk 16, Hv 16 and 32, Dk = Dv 128; short conv K 4 over its ~6000 channels; gated
norm over Hv x Dv) and Granite 4 small-like Mamba-2 shapes (H 48 and 128, P 64, N 128, G 1).
Prints the time (median of repeats), the bytes the op must move (fp32 states read and
written, inputs read, outputs written) as GB/s, and the recurrence's nominal FLOP/s (the
token-by-token count, whatever form the kernel computes it in). A decode step is bound by
reading and writing its states, so its GB/s is read against the machine's memory bandwidth.
--torch times the torch implementation beside the C one (the fallback without the extension).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlab.kernels import recurrent as rc
from kvlab.kernels.ops import kernel_backend_detail, set_num_threads

F32 = 4


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, secs: float, nbytes: float, flops: float) -> None:
    print(f"  {name:<44} {secs * 1e3:9.3f} ms {nbytes / secs / 1e9:8.2f} GB/s "
          f"{flops / secs / 1e9:8.2f} GFLOP/s")


def segments(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences of T // S tokens in slots 0 .. S-1."""
    return torch.arange(S), torch.full((S,), T // S)


def bench_gdr(T: int, S: int, Hk: int, Hv: int, D: int, impls: dict, repeats: int) -> None:
    q = F.normalize(torch.randn(T, Hk, D), dim=-1)
    k = F.normalize(torch.randn(T, Hk, D), dim=-1)
    v, g, beta = torch.randn(T, Hv, D), -F.softplus(torch.randn(T, Hv)), torch.rand(T, Hv)
    states = torch.zeros(S, Hv, D, D)
    slots, lens = segments(T, S)
    nbytes = F32 * (2 * states.numel() + 2 * q.numel() + 2 * v.numel() + 2 * g.numel())
    flops = 7 * T * Hv * D * D
    for name, fn in impls.items():
        secs = timed(lambda fn=fn: fn(q, k, v, g, beta, states, slots, lens, D ** -0.5), repeats)
        report(f"gated_delta_rule Hv={Hv} T={T} seqs={S} [{name}]", secs, nbytes, flops)


def bench_ssd(T: int, S: int, H: int, P: int, N: int, impls: dict, repeats: int) -> None:
    x, dt = torch.randn(T, H, P), F.softplus(torch.randn(T, H) - 2)
    A, D = -torch.rand(H) - 0.5, torch.randn(H)
    B, C = torch.randn(T, 1, N), torch.randn(T, 1, N)
    states = torch.zeros(S, H, P, N)
    slots, lens = segments(T, S)
    nbytes = F32 * (2 * states.numel() + 2 * x.numel() + 2 * B.numel() + dt.numel())
    flops = 5 * T * H * P * N
    for name, fn in impls.items():
        secs = timed(lambda fn=fn: fn(x, dt, A, B, C, D, states, slots, lens), repeats)
        report(f"ssd_scan H={H} T={T} seqs={S} [{name}]", secs, nbytes, flops)


def bench_conv(T: int, S: int, C: int, K: int, impls: dict, repeats: int) -> None:
    x, w, bias = torch.randn(T, C), torch.randn(C, K), torch.randn(C)
    states = torch.zeros(S, K - 1, C)
    slots, lens = segments(T, S)
    nbytes = F32 * (2 * states.numel() + 2 * x.numel() + w.numel())
    for name, fn in impls.items():
        secs = timed(lambda fn=fn: fn(x, w, states, slots, lens, bias, "silu"), repeats)
        report(f"short_conv C={C} T={T} seqs={S} [{name}]", secs, nbytes, 2 * T * C * K)


def bench_norm(T: int, H: int, D: int, impls: dict, repeats: int) -> None:
    x, z, w = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(D)
    nbytes = F32 * 3 * x.numel()
    for name, fn in impls.items():
        secs = timed(lambda fn=fn: fn(x, z, w, 1e-6, D, True), repeats)
        report(f"gated_rms_norm {H}x{D} T={T} [{name}]", secs, nbytes, 8 * x.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="also time the torch implementation")
    args = ap.parse_args()
    set_num_threads(args.threads)
    print(f"kernels: {kernel_backend_detail()}, C recurrent kernels: {rc._use_c(torch.zeros(1))}, "
          f"threads: {args.threads}")
    pick = (lambda c, t: {"C": c, "torch": t}) if args.torch else (lambda c, t: {"C": c})
    gdr = pick(rc.gated_delta_rule, rc.gated_delta_rule_torch)
    ssd = pick(rc.ssd_scan, rc.ssd_scan_torch)
    conv = pick(rc.short_conv, rc.short_conv_torch)
    norm = pick(rc.gated_rms_norm, rc.gated_rms_norm_torch)
    shapes = [(args.prefill, 1)] + [(b, b) for b in map(int, args.batch.split(","))]
    for T, S in shapes:
        print(f"{'prefill' if T > S else 'decode'}: {T} tokens, {S} sequences")
        for Hv in (16, 32):
            bench_gdr(T, S, 16, Hv, 128, gdr, args.repeats)
        for H in (48, 128):
            bench_ssd(T, S, H, 64, 128, ssd, args.repeats)
        bench_conv(T, S, 2 * 16 * 128 + 32 * 128, 4, conv, args.repeats)
        bench_norm(T, 32, 128, norm, args.repeats)


if __name__ == "__main__":
    main()
