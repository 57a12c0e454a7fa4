"""What a machine can do, for the roofline: memory bandwidth, sustained FLOP/s, memory size.

A `HardwareSpec` comes from the built-in table (`hardware.json` beside this file, every
number with its source), from figures the user types (`custom`), or from the cache that
`kvlab probe` writes (read by `kvlab.probe`, which resolves the name `this`). Units inside: bytes, bytes/s, FLOP/s, seconds.

A probed machine also carries `KernelRates`: how fast kvlab's own C kernels and per-layer
Python run there, so that kvlab itself can be predicted (kvlab.estimate.kernel_steps) and not
only an engine at the machine's ceilings.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.errors import KvlabError

GB = 1e9  # bandwidth and traffic: decimal, as spec sheets quote them
GIB = 2**30  # memory capacity: binary, as the 'GB' on a spec sheet really is
TERA = 1e12
_TABLE = Path(__file__).with_name("hardware.json")
_VENDOR_PREFIXES = ("nvidia", "geforce", "amd", "instinct", "apple", "intel")


@dataclass(frozen=True)
class Interconnect:
    """The link between the devices of a tensor-parallel group (kvlab.estimate.parallel)."""

    name: str
    bandwidth: float  # bytes/s one device sends, one direction
    latency: float  # seconds per step of a ring all-reduce (a small message's cost)
    source: str = ""

    @classmethod
    def custom(cls, bandwidth_gbs: float, latency_us: float) -> Interconnect:
        _check_positive("--link-bandwidth (GB/s)", bandwidth_gbs)
        if not (math.isfinite(latency_us) and latency_us >= 0):
            raise KvlabError(f"--link-latency must be >= 0 microseconds, got {latency_us}")
        return cls("the given link", bandwidth_gbs * GB, latency_us * 1e-6, "user")


@dataclass(frozen=True)
class KernelRates:
    """kvlab's own kernels on one machine at one thread count, as `kvlab probe` measured them.

    Weight types are GGML names ("Q8_0", "Q4_K", ...). A batch-1 product over a matrix of
    R rows and B bytes takes about call_seconds + B / weight_read[type] + R * row_seconds[type].
    """

    threads: int
    weight_read: Mapping[str, float]  # bytes/s a batch-1 product streams weights from memory
    row_seconds: Mapping[str, float]  # fixed cost per output row of such a product
    prefill_ops: Mapping[str, float]  # OP/s (2 per weight per row) of a 512-row product
    call_seconds: float  # one product call besides its bytes and rows (cold: a fresh matrix)
    attention_read: float  # KV bytes/s of decode attention, one KV head per cache row
    attention_read_strided: float  # the same with 8 KV heads interleaved in each cache row
    logit_seconds: float  # greedy sampling, per vocabulary entry
    # prefill's element-wise passes over every prompt row, seconds per element: "norm"
    # (RMSNorm, residual), "rope" (per-head norm + RoPE), "gelu" / "silu" (gated activation)
    row_op_seconds: Mapping[str, float]
    # kvlab's engine on synthetic models, by architecture ("llama", "gemma3"): a decode step's
    # seconds besides its reads = step + layers x layer + attended positions x position
    step_seconds: Mapping[str, float]
    layer_seconds: Mapping[str, float]
    position_seconds: Mapping[str, float]
    # interquartile range / median of each timer's repeats (by timer name): the probe's noise
    spread: Mapping[str, float] = field(default_factory=dict)

    def weight_rate(self, qtype: str) -> float:
        """bytes/s for `qtype`; a type the probe did not measure gets the slowest measured."""
        return self.weight_read.get(qtype) or min(self.weight_read.values())

    def row_cost(self, qtype: str) -> float:
        return self.row_seconds.get(qtype, max(self.row_seconds.values(), default=0.0))

    def prefill_rate(self, qtype: str) -> float:
        return self.prefill_ops.get(qtype) or min(self.prefill_ops.values())

    def attention_rate(self, kv_heads: int) -> float:
        """KV bytes/s of decode attention over a cache with `kv_heads` heads per row."""
        return self.attention_read if kv_heads <= 1 else self.attention_read_strided

    def engine(self, architecture: str) -> tuple[float, float, float]:
        """(per step, per layer, per attended position) seconds for `architecture`'s family
        (`engine_family`); a family the probe did not time gets the largest figures timed."""
        family = engine_family(architecture)
        return tuple(  # type: ignore[return-value]
            table.get(family, max(table.values(), default=0.0))
            for table in (self.step_seconds, self.layer_seconds, self.position_seconds))


@dataclass(frozen=True)
class StepFactors:
    """What whole engine steps cost here against the kernel-rate terms of kvlab's step model
    (kvlab.estimate.step_model), as `kvlab probe` timed them on a replica of one model: shared
    caches, thread wake-ups and activation rounding make a real step slower than the sum of
    its kernels' isolated best runs. Each factor scales one group of terms."""

    fixed: float  # one pass over the weights, the engine's per-step and per-layer calls
    kv: Mapping[str, float]  # decode attention over the KV cache, by KV dtype
    batch: float  # each further decode row: its products, logits and sampling
    prefill: float  # prefill rows: their products and element-wise passes
    prefill_attention: float  # prefill attention over the chunk's key range
    model: str = ""  # the model whose replica was timed
    noise: float = 0.0  # largest IQR / median over the timed steps' repeats
    rounds: int = 0  # repeats of each step shape (0: not recorded)
    points: tuple[Mapping[str, Any], ...] = ()  # each timed step: name, median, IQR, fit
    # decode attention by depth, where timed at several: per KV dtype, (context, factor)
    # in rising context; the positions up to each context (past the one before) cost that
    # factor x the kernel rate, those past the last context the last factor
    kv_depths: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # the batch factor by sequences in a step, where timed at several: (sequences, factor)
    # in rising order, interpolated between them and held past either end
    batch_sizes: tuple[tuple[float, float], ...] = ()
    # the prefill factor by chunk length, where timed at several: (tokens, factor) in rising
    # order, interpolated in log(tokens) (a product's rows per weight read saturate) and
    # held past either end
    prefill_sizes: tuple[tuple[float, float], ...] = ()

    def kv_factor(self, kv_dtype: str) -> float:
        """The factor for `kv_dtype`; one the probe did not time gets f32's."""
        return self.kv.get(kv_dtype) or self.kv.get("f32") or 1.0

    def batch_factor(self, sequences: int) -> float:
        """The batch factor for a step of `sequences` (the one factor where not timed)."""
        if not self.batch_sizes:
            return self.batch
        sizes, factors = zip(*self.batch_sizes)
        return float(np.interp(sequences, sizes, factors))

    def prefill_factor(self, tokens: int) -> float:
        """The prefill factor for a chunk of `tokens` (the one factor where not timed)."""
        if not self.prefill_sizes:
            return self.prefill
        sizes, factors = zip(*self.prefill_sizes)
        return float(np.interp(np.log(tokens), np.log(sizes), factors))


@dataclass(frozen=True)
class StreamCosts:
    """What serving costs here besides the engine's steps, as `kvlab probe` timed it: `kvlab
    serve` streaming the model to `kvlab loadtest` on the same machine, whose
    token gaps and first tokens, past the step model's, are these costs."""

    token: float  # seconds per streamed token: its text, SSE chunk, HTTP write, client read
    step: float  # seconds per engine step that streams: outputs handed to the event loop
    request: float  # seconds per request before its first step: HTTP, template, tokenize
    levels: tuple[Mapping[str, Any], ...] = ()  # each load timed: measured and predicted
    serial: float = 0.0  # share of `request` the server spends on one request at a time

    @property
    def intake(self) -> float:
        """Seconds of each request's cost that requests sent together take one after another
        (the server's event loop); the rest passes for all of them at once."""
        return self.request * self.serial

    def step_seconds(self, sampled: int) -> float:
        """Seconds a step that samples `sampled` tokens costs besides the engine's step."""
        return self.step + sampled * self.token if sampled else 0.0


def engine_family(architecture: str) -> str:
    """The kvlab model code an architecture runs through: "gemma3" (pre and post norms,
    QK-norm, GeGLU) or "llama" (Llama, Qwen2, Qwen3: fewer calls per layer, SwiGLU)."""
    return "gemma3" if architecture.startswith("gemma") else "llama"


@dataclass(frozen=True)
class HardwareSpec:
    """One machine. `flops` holds sustained FLOP/s by dtype ("fp32", "bf16", "fp16", ...)."""

    name: str
    bandwidth: float  # bytes/s of the memory that holds the weights
    flops: Mapping[str, float]
    memory_bytes: int | None  # None: unknown, fit checks are skipped
    kind: str = "custom"  # "cpu", "gpu", "apple", "custom"
    default_dtype: str = "fp32"
    sources: Mapping[str, str] = field(default_factory=dict)
    key: str = "custom"
    kernels: KernelRates | None = None  # kvlab's own kernels, where `kvlab probe` measured them
    steps: StepFactors | None = None  # whole steps against those kernels, where timed
    interconnect: Interconnect | None = None  # between devices, where the table knows it
    stream: StreamCosts | None = None  # serving's costs besides the steps, where timed

    def __post_init__(self) -> None:
        _check_positive("bandwidth (GB/s)", self.bandwidth / GB)
        if not self.flops:
            raise KvlabError(f"hardware {self.name!r} has no FLOP/s figure; pass --tflops T")
        for dtype, rate in self.flops.items():
            _check_positive(f"{dtype} TFLOPS", rate / TERA)
        if self.memory_bytes is not None:
            _check_positive("memory (GiB)", self.memory_bytes / GIB)

    def flop_rate(self, dtype: str | None = None) -> float:
        """Sustained FLOP/s for `dtype` (None: the part's default dtype)."""
        dtype = dtype or self.default_dtype
        if dtype not in self.flops:
            raise KvlabError(f"{self.name} has no {dtype} FLOP/s figure; "
                             f"valid: {', '.join(sorted(self.flops))}")
        return self.flops[dtype]

    @classmethod
    def from_name(cls, name: str) -> HardwareSpec:
        """A part from the built-in table (`this`, the probed machine, is
        `kvlab.probe.resolve_hardware`'s to read)."""
        if name.strip().lower() == "this":
            raise KvlabError("hardware 'this' is the machine `kvlab probe` measured: read it "
                             "with kvlab.probe.resolve_hardware, or name a part from the table")
        table = _parts()
        key = _lookup_key(name)
        if key is None:
            raise KvlabError(_unknown_name_message(name))
        return _from_table_entry(key, table[key])

    @classmethod
    def custom(cls, bandwidth_gbs: float, tflops: float,
               memory_gib: float | None = None, name: str = "custom") -> HardwareSpec:
        """Figures typed by the user: GB/s, sustained TFLOPS (any dtype), GiB."""
        _check_positive("--bandwidth (GB/s)", bandwidth_gbs)
        _check_positive("--tflops", tflops)
        if memory_gib is not None:
            _check_positive("--memory (GiB)", memory_gib)
        return cls(name=name, bandwidth=bandwidth_gbs * GB, flops=_any_dtype(tflops * TERA),
                   memory_bytes=None if memory_gib is None else int(memory_gib * GIB),
                   sources={"bandwidth": "user", "flops": "user", "memory": "user"})

    def with_overrides(self, bandwidth_gbs: float | None = None, tflops: float | None = None,
                       memory_gib: float | None = None) -> HardwareSpec:
        """This part with some figures replaced by the user's."""
        spec, sources = self, dict(self.sources)
        if bandwidth_gbs is not None:
            _check_positive("--bandwidth (GB/s)", bandwidth_gbs)
            spec, sources["bandwidth"] = replace(spec, bandwidth=bandwidth_gbs * GB), "user"
        if tflops is not None:
            _check_positive("--tflops", tflops)
            spec = replace(spec, flops=_any_dtype(tflops * TERA))
            sources["flops"] = "user"
        if memory_gib is not None:
            _check_positive("--memory (GiB)", memory_gib)
            spec, sources["memory"] = replace(spec, memory_bytes=int(memory_gib * GIB)), "user"
        return replace(spec, sources=sources)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "kind": self.kind,
                "bandwidth_gbs": self.bandwidth / GB,
                "sustained_tflops": {k: v / TERA for k, v in self.flops.items()},
                "memory_gib": None if self.memory_bytes is None else self.memory_bytes / GIB,
                "default_dtype": self.default_dtype, "sources": dict(self.sources),
                "kernels": None if self.kernels is None else asdict(self.kernels),
                "interconnect": None if self.interconnect is None else asdict(self.interconnect),
                "steps": None if self.steps is None else asdict(self.steps)}


def known_parts() -> list[HardwareSpec]:
    """Every part of the built-in table, in table order."""
    return [_from_table_entry(key, entry) for key, entry in _parts().items()]


def _any_dtype(rate: float) -> dict[str, float]:
    """A single user figure stands for every dtype the estimator may ask about."""
    return {d: rate for d in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")}


def _check_positive(what: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise KvlabError(f"{what} must be a positive finite number, got {value!r}")


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return json.loads(_TABLE.read_text())


def _parts() -> dict[str, dict[str, Any]]:
    return _table()["parts"]


def _from_table_entry(key: str, entry: Mapping[str, Any]) -> HardwareSpec:
    fraction = _table()["sustained_fraction"][entry["kind"]]
    flops = {dtype: tf * TERA * fraction for dtype, tf in entry["peak_tflops"].items()}
    sources = dict(entry["source"])
    sources["flops"] = f"{sources['flops']}; sustained = {fraction:.0%} of peak"
    link = entry.get("interconnect")
    interconnect = None if link is None else Interconnect(
        link["name"], link["bandwidth_gbs"] * GB, link["latency_us"] * 1e-6, link["source"])
    return HardwareSpec(name=entry["name"], bandwidth=entry["bandwidth_gbs"] * GB, flops=flops,
                        memory_bytes=int(entry["memory_gb"] * GIB), kind=entry["kind"],
                        default_dtype=entry["default_dtype"], sources=sources, key=key,
                        interconnect=interconnect)


def _squash(name: str) -> str:
    """'NVIDIA GeForce RTX_4090' -> 'rtx4090': lower case, vendor words and separators gone."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    while words and words[0] in _VENDOR_PREFIXES:
        words.pop(0)
    return "".join(words)


def _name_index() -> dict[str, str]:
    """Squashed key or alias -> table key."""
    index: dict[str, str] = {}
    for key, entry in _parts().items():
        for alias in (key, *entry.get("aliases", [])):
            index[_squash(alias)] = key
    return index


def _lookup_key(name: str) -> str | None:
    return _name_index().get(_squash(name))


def _unknown_name_message(name: str) -> str:
    index = _name_index()
    close = difflib.get_close_matches(_squash(name), list(index), n=6, cutoff=0.5)
    keys = list(dict.fromkeys(index[c] for c in close))[:3]
    hint = f"closest: {', '.join(keys)}; " if keys else ""
    return (f"unknown hardware {name!r}; {hint}see `kvlab estimate --list-hardware`, "
            "use `this` after `kvlab probe`, or give --bandwidth GB/s --tflops T")
