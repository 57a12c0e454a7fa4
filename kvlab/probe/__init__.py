"""Measurement: what this machine does, for the estimator.

`kvlab.probe.machine.probe` times memory bandwidth, matmul FLOP/s, kvlab's own kernels
(`kernels`), its engine's overhead (`engine_overhead`), whole engine steps on a replica of a
model (`steps`) and serving's streaming costs (`stream_costs`); `cache` keeps the result and
resolves "this machine" from it. Everything here hands numbers to `kvlab.estimate`, which
never imports back. This package's import runs nothing and pulls in no torch: the measuring
modules are imported where they are used.
"""

from kvlab.probe.cache import (
    PROBE_VERSION,
    ProbeResult,
    cache_path,
    load_probe,
    read_probe,
    resolve_hardware,
    save_probe,
    this_machine,
)

__all__ = ["PROBE_VERSION", "ProbeResult", "cache_path", "load_probe", "read_probe",
           "resolve_hardware", "save_probe", "this_machine"]
