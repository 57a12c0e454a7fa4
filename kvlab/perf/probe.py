"""Measure this machine for the roofline: memory read bandwidth and matmul FLOP/s, and
for predicting kvlab itself: how fast kvlab's own kernels and engine run here.

Bandwidth: a C stream read of a buffer far larger than any cache on kvlab's kernel
threads (torch.sum without the C extension), best of several runs. FLOP/s: square torch matmuls (fp32, bf16 on request), best of several. kvlab's
kernels and engine overhead: `kvlab.perf.probe_kernels`. Each figure has a time budget,
so a probe ends in well under 30 s. Results are cached as JSON at
$KVLAB_CACHE_DIR/probe.json (default ~/.cache/kvlab/probe.json) for
`kvlab estimate --hardware this`. Caches of versions 1 (before the kernel figures) and 2
(before the Q8_0x8 kernels) and 3 (before the whole-step timings) still load; `kvlab bench
--estimate` probes again for them.

Whole steps: kvlab's engine on a replica of the model to be predicted (the default model
unless named), each step shape repeated and its median kept (kvlab.perf.probe_steps); the
factors fitted to them scale the kernel-rate terms of every kvlab prediction.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvlab.errors import KvlabError
from kvlab.perf.hardware import (
    GB,
    GIB,
    TERA,
    HardwareSpec,
    KernelRates,
    StepFactors,
    StreamCosts,
)
from kvlab.perf.probe_kernels import best_seconds, measure_kernels

CACHE_ENV = "KVLAB_CACHE_DIR"
PROBE_VERSION = 5  # 2: kvlab's kernel and engine figures (`kernels`); 3: with Q8_0x8;
# 4: kernel figures as medians, whole engine steps (`steps`); 5: steps at the engine's KV
# dtype, three depths and four batch sizes, serving's costs besides the steps (`stream`)
READABLE_VERSIONS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class ProbeResult:
    bandwidth_gbs: float
    tflops: dict[str, float]  # sustained, by dtype
    memory_gib: float
    threads: int
    cpu: str
    measured_at: str  # ISO 8601, UTC
    details: dict[str, str] = field(default_factory=dict)  # figure ("bandwidth", "fp32") -> how
    version: int = PROBE_VERSION
    kernels: dict[str, Any] | None = None  # KernelRates as a dict; None: not measured
    steps: dict[str, Any] | None = None  # StepFactors as a dict; None: not timed
    stream: dict[str, Any] | None = None  # StreamCosts as a dict; None: not timed

    def to_hardware(self) -> HardwareSpec:
        day = self.measured_at[:10]
        return HardwareSpec(
            name=f"this machine ({self.cpu}, {self.threads} threads, probed {day})",
            bandwidth=self.bandwidth_gbs * GB,
            flops={dtype: tf * TERA for dtype, tf in self.tflops.items()},
            memory_bytes=int(self.memory_gib * GIB) if self.memory_gib > 0 else None,
            kind="cpu", default_dtype="fp32",
            sources=self._sources(), key="this", kernels=self.kernel_rates(),
            steps=self.step_factors(), stream=self.stream_costs())

    def kernel_rates(self) -> KernelRates | None:
        return None if self.kernels is None else KernelRates(**self.kernels)

    def step_factors(self) -> StepFactors | None:
        from kvlab.perf.step_model import factors_from_dict

        return None if self.steps is None else factors_from_dict(self.steps)

    def stream_costs(self) -> StreamCosts | None:
        if self.stream is None:
            return None
        return StreamCosts(**{**self.stream, "levels": tuple(self.stream.get("levels", ()))})

    def _sources(self) -> dict[str, str]:
        day = f"kvlab probe {self.measured_at[:10]}"
        flops = "; ".join(f"{d} {self.details.get(d, '')}" for d in self.tflops)
        return {"bandwidth": f"{day}: {self.details.get('bandwidth', '')}",
                "memory": f"{day}: {self.details.get('memory', '')}", "flops": f"{day}: {flops}"}


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvlab"
    return Path(root) / "probe.json"


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
    from kvlab.kernels import kernel_backend

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
    from kvlab.perf.kvlab_steps import unsupported_reason
    from kvlab.perf.model import ModelSpec
    from kvlab.perf.probe_steps import default_kv_dtype, measure_steps
    from kvlab.weights import default_model_path

    path = Path(model) if model is not None else default_model_path()
    spec = ModelSpec.from_gguf(path)
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
    from kvlab.perf.probe_serving import LEVELS, measure_stream_costs

    stream = measure_stream_costs(path, spec, result.to_hardware(), result.threads,
                                  default_kv_dtype())
    details["stream"] = (f"kvlab serve on {spec.name}, kvlab loadtest at "
                         f"{' and '.join(map(str, LEVELS))} streams beside it")
    return replace(result, stream=asdict(stream), details=details)


def _set_kernel_threads(threads: int) -> None:
    """The C kernels' thread count too: the kernel figures are measured at it."""
    from kvlab.kernels import set_num_threads

    set_num_threads(threads)


def measure_bandwidth(buffer_mib: int = 512, budget_s: float = 6.0,
                      huge_pages: bool = True) -> tuple[float, int]:
    """Best bytes/s of a full read of a buffer, and how many runs it took: kvlab's C stream
    read on its kernel threads (loads only, nothing else per byte), or torch.sum where the
    C extension is not built. The buffer is in the pages kvlab's weights are in (2 MiB where
    the system gives them, kernels/hugepages.py), so this is what a decode step could stream;
    `huge_pages=False` reads 4 KiB pages, as torch's own buffers and a file's map are."""
    from kvlab.kernels import stream_read
    from kvlab.kernels.hugepages import weight_buffer

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
    from kvlab.kernels import kernel_backend, qmatmul, quantize

    if kernel_backend() == "torch":
        return None, 0
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(2048, 2048, generator=gen), GGMLQuantizationType.Q4_K)
    x = torch.randn(512, 2048, generator=gen)
    qmatmul(x, w)  # warm-up
    seconds, runs = best_seconds(lambda: qmatmul(x, w), budget_s, max_runs=20)
    return 2 * 512 * 2048 * 2048 / seconds, runs


def save_probe(result: ProbeResult, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return path


def load_probe(path: Path | None = None) -> HardwareSpec:
    """The cached probe as a HardwareSpec; a clear error when there is none."""
    return read_probe(path).to_hardware()


def read_probe(path: Path | None = None) -> ProbeResult:
    """The cached probe as measured; a clear error when there is none or it is unreadable."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else '?'}"
                             f"; readable: {', '.join(map(str, READABLE_VERSIONS))}")
        result = ProbeResult(**data)
        result.kernel_rates()  # a damaged kernels entry fails here, not in a later estimate
        return result
    except FileNotFoundError:
        raise KvlabError(f"no probe results at {path}: run `kvlab probe` first, or name the "
                         "hardware (`kvlab estimate --list-hardware`)") from None
    except (ValueError, TypeError) as e:
        raise KvlabError(f"{path} is not a kvlab probe cache ({e}); run `kvlab probe` again"
                         ) from None


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
