"""The visualiser's predictions: which hardware "this machine" is, the what-if model presets,
and an estimate (kvlab.estimate) turned into the few figures the page shows: for the served
file on a probed machine, kvlab's own engine serving that many users at once (its step
model under its scheduler, kvlab.estimate.serving_replay); otherwise the roofline.

"This machine" is, in order of preference: the `kvlab probe` cache; a quick measurement made
once when first asked (about a second of bandwidth and matmul timing); a named part from the
built-in table. `MachineSource.label` says which, and the page prints it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, ModelSpec, Workload, estimate, known_parts
from kvlab.estimate.hardware import GB, GIB, TERA
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.serving_replay import RequestSpec, predict_serving
from kvlab.estimate.specs import (
    Architecture,
    dense_architecture,
    spec_from_architecture,
    with_caches_of,
)
from kvlab.models.kv_store import KV_DTYPES
from kvlab.probe import load_probe
from kvlab.probe.machine import measure_bandwidth, measure_matmul

log = logging.getLogger("kvlab.server")

FALLBACK_PART = "cpu-ddr4-laptop"
THIS = "this"  # the hardware key of this machine, whatever its source
SERVED = "served"  # the model key of the model the server runs

# Bits per weight as llama.cpp stores them, scales included. "file": as the served file is.
QUANT_BITS: dict[str, float] = {"q4_0": 4.5, "q4_k_m": 4.85, "q5_k_m": 5.69, "q6_k": 6.56,
                                "q8_0": 8.5, "f16": 16.0, "f32": 32.0}
QUANT_LABELS = {"file": "as stored in the served file", "q4_0": "Q4_0 (4.5 bits)",
                "q4_k_m": "Q4_K_M (4.85 bits)", "q5_k_m": "Q5_K_M (5.69 bits)",
                "q6_k": "Q6_K (6.56 bits)", "q8_0": "Q8_0 (8.5 bits)",
                "f16": "F16 / BF16 (16 bits)", "f32": "F32 (32 bits)"}


# public architectures the page offers beside the served model: (label, shape)
PRESETS: dict[str, tuple[str, Architecture]] = {
    "1b": ("1B (Llama 3.2 1B shape)",
           dense_architecture(16, 2048, 32, 8, 64, 8192, 128256, tied=True)),
    "3b": ("3B (Llama 3.2 3B shape)",
           dense_architecture(28, 3072, 24, 8, 128, 8192, 128256, tied=True)),
    "8b": ("8B (Llama 3.1 8B shape)", dense_architecture(32, 4096, 32, 8, 128, 14336, 128256)),
    "14b": ("14B (Qwen2.5 14B shape)", dense_architecture(48, 5120, 40, 8, 128, 13824, 152064)),
    "32b": ("32B (Qwen2.5 32B shape)", dense_architecture(64, 5120, 40, 8, 128, 27648, 152064)),
    "70b": ("70B (Llama 3.1 70B shape)", dense_architecture(80, 8192, 64, 8, 128, 28672, 128256)),
}


@dataclass(frozen=True)
class MachineSource:
    hardware: HardwareSpec
    kind: str  # "probe", "quick", "part"
    label: str  # one line for the page


def this_machine(quick: bool = True) -> MachineSource:
    """The probe cache, else a quick measurement (if allowed), else a named part."""
    try:
        hw = load_probe()
        return MachineSource(hw, "probe", f"{hw.name} (from the `kvlab probe` cache)")
    except KvlabError:
        pass
    if quick:
        try:
            return _quick_measurement()
        except (RuntimeError, MemoryError, KvlabError) as e:  # the page must still load
            log.warning("quick hardware measurement failed: %s", e)
    hw = HardwareSpec.from_name(FALLBACK_PART)
    return MachineSource(hw, "part", f"{hw.name} (a named part from the built-in table: no "
                                     "`kvlab probe` cache; run `kvlab probe` to measure)")


def _quick_measurement() -> MachineSource:
    bandwidth, _ = measure_bandwidth(buffer_mib=128, budget_s=0.4)
    flops, size, _ = measure_matmul("fp32", size=512, budget_s=0.4)
    hw = HardwareSpec(name=f"this machine ({os.cpu_count()} CPUs, quick measurement)",
                      bandwidth=bandwidth, flops={"fp32": flops}, memory_bytes=None, kind="cpu",
                      sources={"bandwidth": "stream read over 128 MiB, ~0.4 s",
                               "flops": f"{size}x{size} fp32 matmul, ~0.4 s"}, key=THIS)
    return MachineSource(hw, "quick", f"{hw.name}: {bandwidth / GB:.1f} GB/s, "
                                      f"{flops / TERA:.3f} TFLOPS fp32 measured at start-up in "
                                      "about a second; `kvlab probe` measures better")


def hardware_choices(machine: MachineSource) -> list[dict[str, Any]]:
    """This machine first, then the built-in table."""
    rows = [{"key": THIS, "name": machine.label}]
    rows += [{"key": hw.key, "name": hw.name, "kind": hw.kind} for hw in known_parts()]
    return rows


def hardware_for(key: str, machine: MachineSource) -> HardwareSpec:
    return machine.hardware if key == THIS else HardwareSpec.from_name(key)


def model_for(key: str, quant: str, served: ModelSpec, served_arch: Architecture) -> ModelSpec:
    """A preset or the served model, at a quantization ("file": the served file as stored)."""
    if quant != "file" and quant not in QUANT_BITS:
        raise KvlabError(f"unknown quantization {quant!r}; valid: file, {', '.join(QUANT_BITS)}")
    if key == SERVED:
        if quant == "file":
            return served
        return with_caches_of(spec_from_architecture(served_arch, QUANT_BITS[quant],
                                                     f"{served.name} at {quant}"), served)
    if key not in PRESETS:
        raise KvlabError(f"unknown model {key!r}; valid: {SERVED}, {', '.join(PRESETS)}")
    if quant == "file":
        raise KvlabError(f"quantization 'file' only applies to the served model; pick one of "
                         f"{', '.join(QUANT_BITS)} for {key}")
    label, arch = PRESETS[key]
    return spec_from_architecture(arch, QUANT_BITS[quant], f"{label}, {quant}")


def predict(model: ModelSpec, hw: HardwareSpec, prompt_tokens: int, output_tokens: int,
            concurrency: int = 1, kv_dtype: str = "f16", scheduler: Any = None
            ) -> dict[str, Any]:
    """The figures the page shows beside a run, all per stream; seconds and tokens/s.
    `scheduler` (a SchedulerConfig; default kvlab's) is the served engine's, for kvlab's
    own figures."""
    wl = Workload(prompt_tokens=max(1, prompt_tokens), output_tokens=max(1, output_tokens),
                  concurrency=max(1, concurrency), kv_dtype=kv_dtype)
    e = estimate(model, hw, wl)
    decode = e.decode_tok_s_mid
    return {
        "prediction": True,
        "hardware": {"key": hw.key, "name": hw.name, "bandwidth_gbs": hw.bandwidth / GB,
                     "tflops": hw.flop_rate(e.compute_dtype) / TERA,
                     "compute_dtype": e.compute_dtype,
                     "memory_gib": None if hw.memory_bytes is None else hw.memory_bytes / GIB},
        "model": {"name": model.name, "params": model.n_params,
                  "weight_bytes": model.weight_bytes,
                  "bits_per_param": 8 * model.weight_bytes / model.n_params},
        "workload": {"prompt_tokens": wl.prompt_tokens, "output_tokens": wl.output_tokens,
                     "concurrency": wl.concurrency, "kv_dtype": kv_dtype},
        "ttft_s": e.ttft, "prefill_s": e.prefill_seconds, "prefill_tok_s": e.prefill_tok_s,
        "prefill_bound": e.prefill_bound,
        "decode_tok_s": decode, "decode_tok_s_range": list(e.decode_tok_s_realistic),
        "decode_tok_s_ceiling": e.decode_tok_s_ceiling, "decode_bound": e.decode_bound,
        "itl_ms": 1e3 / decode, "total_s": e.total_seconds,
        "total_s_range": list(e.total_seconds_range),
        "kv_bytes_per_token": e.kv_bytes_per_token, "kv_bytes": e.kv_bytes,
        "memory_needed_gib": e.memory_needed / GIB, "fits": e.fits,
        "notes": list(e.notes), "engine": "roofline",
    } | kvlab_figures(model, hw, wl, scheduler)


def kvlab_figures(model: ModelSpec, hw: HardwareSpec, wl: Workload, scheduler: Any = None
                  ) -> dict[str, Any]:
    """kvlab's own engine serving `wl.concurrency` users who each send one request at once:
    TTFT, per-stream decode, ITL and response time, medians over the users; {} where kvlab's
    step model does not cover the model, the machine or the KV dtype."""
    if (unsupported_reason(model, hw) or wl.kv_dtype not in KV_DTYPES
            or (wl.kv_dtype != "f32" and hw.steps is None)):
        return {}
    spec = RequestSpec(wl.prompt_tokens, wl.output_tokens, arrival=0.0)
    p = predict_serving(model, hw, [spec] * wl.concurrency, wl.concurrency, scheduler,
                        wl.kv_dtype)
    decode = float(np.median([(len(t.token_times) - 1) / (t.finished - t.token_times[0])
                              for t in p.traces if len(t.token_times) > 1] or [0.0]))
    noise = hw.steps.noise if hw.steps is not None else 0.0
    ttft, total = p.ttft(0.5), float(np.median([t.finished - t.sent for t in p.traces]))
    return {"engine": "kvlab", "ttft_s": ttft, "prefill_s": ttft,
            "prefill_tok_s": wl.prompt_tokens / ttft, "decode_tok_s": decode,
            "decode_tok_s_range": [decode * (1 - noise), decode * (1 + noise)],
            "itl_ms": 1e3 * p.itl(0.5), "total_s": total,
            "total_s_range": [total * (1 - noise), total * (1 + noise)]}
