"""Tensor-parallel and replica configurations, predicted from the roofline (nothing here is
measured: `docs/parallel.md` says what is).

Tensor parallel over N devices splits the model as kvlab.models.sharding does: each
rank reads 1/N of every block's weights and holds 1/N of the KV cache (with fewer KV heads
than ranks, one head each: 1/kv_heads), while the embedding row, the norms and the output
head are read whole (kvlab keeps the head on rank 0, and a step waits for its slowest
rank). A decode step over B sequences then costs

    per rank   max(rank bytes / bandwidth, rank FLOP / FLOP-rate)
    + 2 x layers all-reduces of B x hidden activations, each over a ring of N ranks:
      2 (N - 1) x link latency + 2 (N - 1) / N x bytes / link bandwidth

Prefill's products divide by N too, and add the same all-reduces over the prompt's rows.

Replicas are whole copies (each of N ranks under tensor parallel). A replica serving C
sequences at once finishes C requests every TTFT + (output - 1) decode steps (at the
workload's middle efficiency, as the roofline's total time), so it sustains C / that many
requests a second; a target rate needs ceil(target / that) replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec, Interconnect
from kvlab.estimate.roofline import Estimate
from kvlab.estimate.workload import Workload

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # per all-reduced value, by compute dtype


@dataclass(frozen=True)
class ParallelEstimate:
    """One configuration: `tensor_parallel_size` ranks per replica, `replicas` copies."""

    tensor_parallel_size: int
    replicas: int
    link: Interconnect | None  # None: a single rank, nothing to all-reduce
    rank_weight_bytes: float  # a decode step reads on the busiest rank (batch = concurrency)
    rank_kv_bytes: float  # one sequence's KV on a rank, at the middle of the reply
    allreduce_bytes: float  # one decode all-reduce's payload
    allreduce_seconds: float  # all of a decode step's all-reduces
    step_seconds: float  # decode step ceiling at the workload's concurrency
    single_step_seconds: float  # the same step on one device
    ttft: float
    decode_tok_s: float  # per stream, ceiling
    memory_per_rank: float  # weights + KV for the concurrency at the context
    fits: bool | None
    requests_per_s: float  # all replicas together, at the middle efficiency
    target_rps: float | None
    replicas_needed: int | None  # for target_rps

    @property
    def speedup(self) -> float:
        """Decode step on one device over the step on N ranks."""
        return self.single_step_seconds / self.step_seconds


def allreduce_seconds(nbytes: float, size: int, link: Interconnect) -> float:
    """One ring all-reduce of `nbytes` over `size` ranks: reduce-scatter, then all-gather."""
    if size == 1:
        return 0.0
    hops = 2 * (size - 1)
    return hops * link.latency + hops / size * nbytes / link.bandwidth


def predict_parallel(model: ModelSpec, hw: HardwareSpec, workload: Workload, single: Estimate,
                     size: int = 1, replicas: int = 1, target_rps: float | None = None,
                     link: Interconnect | None = None) -> ParallelEstimate:
    """`single`: the roofline's estimate of the same workload on one device."""
    _check(model, size, replicas, target_rps)
    link = link or hw.interconnect
    if size > 1 and link is None:
        raise KvlabError(f"{hw.name} has no interconnect figure; pass --link-bandwidth GB/s "
                         "and --link-latency us (e.g. 25 and 10 for PCIe 4.0 x16)")
    wl, batch = workload, workload.concurrency
    mid = wl.prompt_tokens + wl.output_tokens / 2
    kv_share = _kv_share(model, size)
    weights = _rank_weight_bytes(model, batch, size)
    kv = float(model.kv_bytes(mid, wl.kv_bytes_per_element)) * kv_share
    step_flop = batch * (model.matmul_flop_per_token() / size + model.output_flop
                         + float(model.attention_flop(mid)) / size)
    rate = hw.flop_rate(wl.compute_dtype)
    payload = batch * (model.hidden_size or 0) * ACTIVATION_BYTES.get(
        wl.compute_dtype or hw.default_dtype, 4)
    reduce_s = 2 * model.n_layers * allreduce_seconds(payload, size, link) if link else 0.0
    step = max((weights + batch * kv) / hw.bandwidth, step_flop / rate) + reduce_s
    single_step = 1.0 / single.decode_tok_s_ceiling
    prefill_reduce = (2 * model.n_layers * allreduce_seconds(payload / batch * wl.prompt_tokens,
                                                             size, link) if link else 0.0)
    ttft = single.prefill_seconds / size + prefill_reduce
    memory = _rank_memory(model, single, size, kv_share)
    per_replica = batch / (ttft + max(wl.output_tokens - 1, 0) * step / wl.efficiency_mid)
    usable = None if hw.memory_bytes is None else hw.memory_bytes * wl.usable_memory
    return ParallelEstimate(
        tensor_parallel_size=size, replicas=replicas, link=link if size > 1 else None,
        rank_weight_bytes=weights, rank_kv_bytes=kv, allreduce_bytes=payload,
        allreduce_seconds=reduce_s, step_seconds=step, single_step_seconds=single_step,
        ttft=ttft, decode_tok_s=1.0 / step, memory_per_rank=memory,
        fits=None if usable is None else memory <= usable,
        requests_per_s=replicas * per_replica, target_rps=target_rps,
        replicas_needed=None if target_rps is None else math.ceil(target_rps / per_replica))


def _check(model: ModelSpec, size: int, replicas: int, target_rps: float | None) -> None:
    if size < 1 or replicas < 1:
        raise KvlabError(f"--tensor-parallel-size and --replicas must be >= 1, got {size} "
                         f"and {replicas}")
    if target_rps is not None and not target_rps > 0:
        raise KvlabError(f"--target-rps must be a positive rate, got {target_rps}")
    heads = {lyr.heads for lyr in model.layers if lyr.heads}
    bad = sorted(h for h in heads if h % size)
    if size > 1 and bad:
        raise KvlabError(f"{model.name}'s {bad[0]} attention heads cannot be split {size} ways "
                         "(the size must divide them)")


def _kv_share(model: ModelSpec, size: int) -> float:
    """Share of a sequence's KV one rank holds: 1/N, or 1/kv_heads when those are fewer."""
    kv_heads = min((lyr.kv_heads for lyr in model.layers if lyr.kv_heads), default=0)
    return 1.0 / min(size, kv_heads) if kv_heads else 1.0 / size


def _rank_weight_bytes(model: ModelSpec, batch: int, size: int) -> float:
    """The blocks' share of this rank plus the embedding rows, norms and head, whole."""
    blocks = sum(model.layer_read_bytes(layer, batch) for layer in model.layers)
    return model.decode_weight_bytes(batch) - blocks + blocks / size


def _rank_memory(model: ModelSpec, single: Estimate, size: int, kv_share: float) -> float:
    """Rank 0's resident weights (its blocks' share, the tables whole) plus its KV."""
    blocks = sum(lyr.dense_bytes + lyr.expert_bytes for lyr in model.layers)
    weights = model.weight_bytes - blocks + blocks / size
    return weights + single.kv_bytes * kv_share


def format_parallel(p: ParallelEstimate) -> str:
    """The configuration's figures as the text report's last section."""
    head = f"parallel  {p.replicas} replica(s) x tensor parallel {p.tensor_parallel_size}"
    lines = [head + (f" over {p.link.name}" if p.link else "") + " (predicted)"]
    lines.append(f"          per rank: {p.rank_weight_bytes / 1e6:,.1f} MB of weights + "
                 f"{p.rank_kv_bytes / 1e6:,.2f} MB KV per sequence a step; memory "
                 f"{p.memory_per_rank / 2**30:,.2f} GiB"
                 + ("" if p.fits is None else (" (fits)" if p.fits else " (does NOT fit)")))
    if p.link:
        lines.append(f"          all-reduce: {p.allreduce_bytes:,.0f} B each, "
                     f"{p.allreduce_seconds * 1e3:,.3f} ms a decode step")
    lines.append(f"          decode step {p.step_seconds * 1e3:,.2f} ms ({p.decode_tok_s:,.1f} "
                 f"tok/s per stream ceiling), {p.speedup:.2f}x one device; TTFT "
                 f"{p.ttft * 1e3:,.1f} ms")
    rate = f"          {p.requests_per_s:,.2f} requests/s from {p.replicas} replica(s)"
    if p.replicas_needed is not None:
        rate += f"; {p.target_rps:g} requests/s needs {p.replicas_needed} replica(s)"
    return "\n".join(lines + [rate]) + "\n\n"
