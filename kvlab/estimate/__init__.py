"""Prediction: roofline estimates of prefill, decode, memory and batching, and kvlab's own
step model and serving replay, before anything runs.

This package is arithmetic over a model spec (`kvlab.cost.ModelSpec`), a hardware spec and a
workload; it runs nothing. Measuring a machine is `kvlab.probe`, which hands this package
its figures (and resolves "this machine", `--hardware this`); imports point from probe to
here, never back.

Decode is bandwidth-bound: tokens/s ~= bandwidth / bytes read per token (weights plus the
KV cache). Prefill is compute-bound: seconds ~= FLOP / sustained FLOP/s. This package turns
a model, a machine and a workload into those figures, and lays a measurement beside them.

Python API::

    from kvlab.estimate import HardwareSpec, Workload, compare, estimate, spec_from_gguf

    model = spec_from_gguf("gemma-3-270m-q4_k_m.gguf")         # no tensor data is read
    model = spec_from_hf_config("config.json", bits=16)
    model = spec_from_description(params=8e9, bits=4.5)        # or size_bytes=4.9e9, plus
                                                               # layers, kv_heads, head_dim, ...
    hw = HardwareSpec.from_name("rtx-4090")                    # built-in table, with sources
    hw = HardwareSpec.custom(bandwidth_gbs=273, tflops=20, memory_gib=48)
    hw = kvlab.probe.this_machine()                            # the `kvlab probe` cache
    e = estimate(model, hw, Workload(prompt_tokens=3000, output_tokens=200))
    e.ttft, e.prefill_seconds, e.decode_tok_s_ceiling, e.decode_tok_s_realistic,
    e.total_seconds, e.kv_bytes, e.fits, e.max_concurrency, e.max_context,
    e.compute_bound_batch, e.batch_sweep, e.context_sweep, e.offload, e.to_dict()
    print(format_estimate(e))
    print(compare(e, Measurement(ttft=0.4, decode_tok_s=61.0)))   # or a dict of the same

How the figures are counted (see roofline.py):
- bytes per decode step: every weight a step touches, once: embedding lookups read one
  row, the output matrix (the embedding table when tied) is read in full; MoE layers read
  the experts their tokens route to. Plus each sequence's KV cache, sliding-window layers
  capped at their window.
- prefill FLOP: 2 x block parameters per token, causal attention growing with context,
  the output projection only at positions whose logits are needed (one per prompt).
- realistic decode: 60-85 % of the ceiling (Workload.efficiency); the total response
  time is TTFT + (output - 1) decode steps, the first token coming out of prefill.

For kvlab's own CPU engine the roofline's generic 60-85 % is replaced by kvlab's step
model (kvlab.estimate.kernel_steps, used by `kvlab bench --estimate` and `kvlab estimate
--engine kvlab`): the model's counted matrices, heads and KV bytes over the rates `kvlab
probe` measured for kvlab's own kernels (weight reads by type, integer prefill products,
decode attention over an f32 cache) and for its engine's per-layer and per-step overhead
(kvlab.probe.kernels, kvlab.probe.engine_overhead). Steps of several sequences, chunked prefill beside
decodes, and the KV dtypes are kvlab.estimate.step_model, whose terms are scaled by factors
fitted to whole engine steps `kvlab probe` timed on a replica of the model
(kvlab.probe.steps: medians of repeats, their spread reported); kvlab.estimate.serving_replay
replays kvlab's scheduler over it to predict serving (`kvlab estimate --engine kvlab
--concurrency N`, `kvlab loadtest --estimate`, the visualiser).
"""

from kvlab.cost import LayerSpec, ModelSpec
from kvlab.estimate.hardware import HardwareSpec, known_parts
from kvlab.estimate.report import Measurement, compare, format_estimate
from kvlab.estimate.roofline import BatchPoint, ContextPoint, Estimate, OffloadEffect, estimate
from kvlab.estimate.specs import (
    load_model_spec,
    spec_from_description,
    spec_from_gguf,
    spec_from_hf_config,
)
from kvlab.estimate.workload import KV_BYTES_PER_ELEMENT, Workload

__all__ = [
    "KV_BYTES_PER_ELEMENT", "BatchPoint", "ContextPoint", "Estimate", "HardwareSpec",
    "LayerSpec", "Measurement", "ModelSpec", "OffloadEffect", "Workload", "compare",
    "estimate", "format_estimate", "known_parts", "load_model_spec", "spec_from_description",
    "spec_from_gguf", "spec_from_hf_config",
]
