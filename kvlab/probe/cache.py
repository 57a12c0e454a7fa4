"""The probe's cache: what `kvlab probe` measured on this machine, kept as JSON at
$KVLAB_CACHE_DIR/probe.json (default ~/.cache/kvlab/probe.json), and "this machine" resolved
from it. Reading the cache runs nothing, so the estimator's callers use this module without
the measuring code (`kvlab.probe.machine`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.estimate.hardware import (
    GB,
    GIB,
    TERA,
    HardwareSpec,
    KernelRates,
    StepFactors,
    StreamCosts,
)
from kvlab.estimate.step_model import factors_from_dict

CACHE_ENV = "KVLAB_CACHE_DIR"
PROBE_VERSION = 5  # the layout this kvlab writes: kernel rates, whole steps, stream costs
# older layouts still load (their missing figures read as not measured); `kvlab bench
# --estimate` probes again when the cache is not of this version
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


def this_machine(path: Path | None = None) -> HardwareSpec:
    """The figures `kvlab probe` measured on this machine."""
    return load_probe(path)


def resolve_hardware(name: str) -> HardwareSpec:
    """A part from the built-in table, or `this`: the machine `kvlab probe` measured."""
    return this_machine() if name.strip().lower() == "this" else HardwareSpec.from_name(name)
