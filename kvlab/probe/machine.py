"""Measure this machine for the roofline: memory read bandwidth and matmul FLOP/s, and
for predicting kvlab itself: how fast kvlab's own kernels and engine run here.

Bandwidth: a C stream read of a buffer far larger than any cache on kvlab's kernel
threads (torch.sum without the C extension), best of several runs. FLOP/s: square torch
matmuls (fp32, bf16 on request), best of several. kvlab's kernels and engine overhead:
`kvlab.probe.kernels`. Each figure has a time budget, so a probe ends in well under 30 s.
The result is a `ProbeResult`, which `kvlab.probe.cache` saves for `kvlab estimate
--hardware this`.

Whole steps: kvlab's engine on a replica of the model to be predicted (the default model
unless named), each step shape repeated and its median kept (kvlab.probe.steps); the
factors fitted to them scale the kernel-rate terms of every kvlab prediction.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from kvlab.errors import KvlabError
from kvlab.estimate.hardware import GB, GIB, TERA
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.specs import spec_from_gguf
from kvlab.kernels import kernel_backend, qmatmul, quantize, set_num_threads, stream_read
from kvlab.kernels.hugepages import weight_buffer
from kvlab.probe.cache import ProbeResult
from kvlab.probe.kernels import measure_kernels
from kvlab.probe.steps import default_kv_dtype, measure_steps
from kvlab.probe.stream_costs import LEVELS, measure_stream_costs
from kvlab.probe.timing import best_seconds
from kvlab.weights.default_model import default_model_path


def probe(threads: int | None = None, bf16: bool = False, buffer_mib: int = 512,
          matmul_size: int = 2048, budget_s: float = 6.0, kernels: bool = True,
          model: str | Path | None = None, steps: bool = True, serving: bool = True
          ) -> ProbeResult:
    """Measure bandwidth and FLOP/s, each within about `budget_s` seconds, and (unless
    `kernels` is False) kvlab's own kernels and engine in about 1.5 times that, then
    (unless `steps` is False) whole engine steps on a replica of `model` (a GGUF file;
    default: the default model) in about a minute, and (unless `serving` is False) kvlab
    serve streaming that replica to kvlab loadtest, in about 30 s."""
    if threads is not None:
        if threads < 1:
            raise KvlabError(f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
        _set_kernel_threads(threads)
    bandwidth, bw_runs = measure_bandwidth(buffer_mib, budget_s)

    how = "C stream read" if kernel_backend() != "torch" else "torch.sum"
    details = {"bandwidth": f"{how} over {buffer_mib} MiB in the weights' pages, best of "
                            f"{bw_runs}",
               "memory": "physical memory (sysconf)"}
    tflops: dict[str, float] = {}
    for dtype in ("fp32", "bf16") if bf16 else ("fp32",):
        rate, size, runs = measure_matmul(dtype, matmul_size, budget_s)
        tflops[dtype] = rate / TERA
        details[dtype] = f"{size}x{size} matmul, best of {runs}"
    rates = measure_kernels(1.5 * budget_s) if kernels else None
    if rates is not None:
        tflops["int8"] = rates.prefill_ops["Q4_K"] / TERA
        details["int8"] = ("kvlab integer kernels: 512 rows x Q4_K 1024x2048, best of a few "
                           "(what prefill of a quantized model runs)")
        details["kernels"] = ("kvlab's products over 128 MiB per weight type, decode attention "
                              "over 64 MiB of f32 K/V, its sampler, its engine on tiny models")
    else:
        rate, runs = measure_int8_kernels(budget_s)
        if rate:
            tflops["int8"] = rate / TERA
            details["int8"] = (f"kvlab integer kernels: 512 rows x Q4_K 2048x2048, best of "
                               f"{runs} (what prefill of a quantized model runs)")
    result = ProbeResult(
        bandwidth_gbs=bandwidth / GB, tflops=tflops, memory_gib=_physical_memory() / GIB,
        threads=rates.threads if rates else torch.get_num_threads(), cpu=_cpu_name(),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), details=details,
        kernels=None if rates is None else asdict(rates))
    return with_steps(result, model, serving) if steps and rates is not None else result


def with_steps(result: ProbeResult, model: str | Path | None = None,
               serving: bool = True) -> ProbeResult:
    """`result` with whole engine steps timed on a replica of `model` (default: the default
    model), then (with `serving`) serving's costs besides them, the model itself served;
    unchanged, with the reason in its details, where kvlab's step model does not cover it."""
    path = Path(model) if model is not None else default_model_path()
    spec = spec_from_gguf(path)
    hw = result.to_hardware()
    reason = unsupported_reason(spec, hw)
    if reason:
        return replace(result, details={**result.details, "steps": f"not timed: {reason}"})
    details = dict(result.details)
    factors = measure_steps(path, spec, hw, result.threads)
    details["steps"] = (f"kvlab's engine on a replica of {spec.name} (random weights, the "
                        f"model's sizes and types), median of {factors.rounds} repeats per "
                        f"step shape, {default_kv_dtype()} KV")
    result = replace(result, steps=asdict(factors), details=details)
    if not serving:
        return result

    stream = measure_stream_costs(path, spec, result.to_hardware(), result.threads,
                                  default_kv_dtype())
    details["stream"] = (f"kvlab serve on {spec.name}, kvlab loadtest at "
                         f"{' and '.join(map(str, LEVELS))} streams beside it")
    return replace(result, stream=asdict(stream), details=details)


def _set_kernel_threads(threads: int) -> None:
    """The C kernels' thread count too: the kernel figures are measured at it."""
    set_num_threads(threads)


def measure_bandwidth(buffer_mib: int = 512, budget_s: float = 6.0,
                      huge_pages: bool = True) -> tuple[float, int]:
    """Best bytes/s of a full read of a buffer, and how many runs it took: kvlab's C stream
    read on its kernel threads (loads only, nothing else per byte), or torch.sum where the
    C extension is not built. The buffer is in the pages kvlab's weights are in (2 MiB where
    the system gives them, kernels/hugepages.py), so this is what a decode step could stream;
    `huge_pages=False` reads 4 KiB pages, as torch's own buffers and a file's map are."""
    nbytes = buffer_mib * 2**20
    raw = weight_buffer(nbytes) if huge_pages else torch.empty(nbytes, dtype=torch.uint8)
    x = raw.view(torch.float32)
    x.fill_(1.0)  # first touch
    stream_read(x)  # warm-up
    seconds, runs = best_seconds(lambda: stream_read(x), budget_s, max_runs=20)
    return nbytes / seconds, runs


def measure_matmul(dtype: str = "fp32", size: int = 2048, budget_s: float = 6.0
                   ) -> tuple[float, int, int]:
    """Best FLOP/s of a square matmul; halves the size while one run would eat the budget."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    while True:
        a = torch.randn(size, size).to(torch_dtype)
        b = torch.randn(size, size).to(torch_dtype)
        start = time.perf_counter()
        a @ b  # warm-up, and a measure of how long one run takes
        if time.perf_counter() - start < budget_s / 4 or size <= 256:
            break
        size //= 2
    seconds, runs = best_seconds(lambda: a @ b, budget_s, max_runs=30)
    return 2 * size**3 / seconds, size, runs


def measure_int8_kernels(budget_s: float = 6.0) -> tuple[float | None, int]:
    """Best OP/s of kvlab's own quantized product (activations in 8 bits, as its prefill
    runs them) on a random Q4_K matrix; None when the C kernels are not built."""
    if kernel_backend() == "torch":
        return None, 0
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(2048, 2048, generator=gen), GGMLQuantizationType.Q4_K)
    x = torch.randn(512, 2048, generator=gen)
    qmatmul(x, w)  # warm-up
    seconds, runs = best_seconds(lambda: qmatmul(x, w), budget_s, max_runs=20)
    return 2 * 512 * 2048 * 2048 / seconds, runs


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
