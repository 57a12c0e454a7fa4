"""The roofline: how long prefill and decode take, what fits, how batching scales.

A step takes max(bytes / bandwidth, FLOP / FLOP-rate), plus the bytes of offloaded layers
over the slower memory's bandwidth. Prefill over P tokens reads the weights once and does
P tokens of matmuls (output projection only where logits are needed) plus causal attention;
it is compute-bound for any real prompt. A decode step over B sequences reads the weights
once and each sequence's KV cache, and does B tokens of FLOP; it stays bandwidth-bound
until B is large. A hybrid's recurrent layers keep no KV: each sequence's fixed-size state
sits in memory whatever its context and a decode step reads and writes it once, so their
share of the step stays flat as the context grows. The first reply token comes out of prefill, so a reply of N tokens costs
TTFT + (N - 1) decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError
from kvlab.estimate.hardware import HardwareSpec
from kvlab.estimate.workload import Workload

MAX_SWEEP_BATCH = 1024
_REPLY_SAMPLES = 2048  # decode steps sampled across the reply: step time is piecewise linear


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    aggregate_tok_s: float  # decode ceiling, all sequences together
    per_stream_tok_s: float
    bound: str  # "weights" / "kv" (bandwidth-bound: which bytes dominate), "compute", "offload"
    fits: bool | None  # weights + KV for `batch` sequences at the context; None: unknown


@dataclass(frozen=True)
class ContextPoint:
    context: int
    tok_s: float  # decode ceiling per stream at the workload's concurrency
    kv_bytes: float  # one sequence
    fits: bool | None


@dataclass(frozen=True)
class OffloadEffect:
    layers: int
    bandwidth: float  # bytes/s of the slower memory
    slow_bytes_per_step: float  # read from it each decode step, mid-reply
    tok_s_without: float  # decode ceiling with every layer in fast memory
    tok_s_with: float
    fast_memory_saved: float  # bytes


@dataclass(frozen=True)
class Estimate:
    """Every predicted figure; seconds, bytes, FLOP, tokens/s. Decode is per stream."""

    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    compute_dtype: str
    prefill_flop: float
    prefill_flop_per_token: float
    prefill_seconds: float
    prefill_bound: str
    ttft: float
    decode_weight_bytes: float  # weights one step reads (batch = concurrency)
    decode_kv_read_bytes: float  # KV one sequence's step reads, mean over the reply
    weights_only_tok_s: float  # bandwidth / weight bytes: the rule of thumb
    decode_tok_s_ceiling: float  # mean over the reply, at the workload's concurrency
    decode_tok_s_realistic: tuple[float, float]
    decode_bound: str
    aggregate_tok_s_ceiling: float
    total_seconds: float  # TTFT + (N - 1) steps at the middle of the realistic range
    total_seconds_range: tuple[float, float]
    kv_bytes_per_token: float  # full attention, before any sliding-window cap
    kv_bytes: float  # context x concurrency, window caps applied
    memory_needed: float  # in the fast memory: resident weights + KV
    memory_usable: float | None
    fits: bool | None
    max_concurrency: int | None  # at the workload's context; None: KV does not limit it
    max_context: int | None  # at the workload's concurrency, up to the model's maximum
    compute_bound_batch: int | None  # first batch whose decode step is compute-bound
    batch_sweep: tuple[BatchPoint, ...]
    context_sweep: tuple[ContextPoint, ...]
    offload: OffloadEffect | None
    notes: tuple[str, ...] = field(default_factory=tuple)
    state_bytes_per_seq: float = 0.0  # recurrent layers' state, one sequence, any context
    state_bytes: float = 0.0  # x concurrency: part of memory_needed beside kv_bytes

    @property
    def decode_tok_s_mid(self) -> float:
        return self.decode_tok_s_ceiling * self.workload.efficiency_mid

    @property
    def prefill_tok_s(self) -> float:
        return self.workload.prompt_tokens / self.prefill_seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: the model and hardware as summaries, everything else as is."""
        out: dict[str, Any] = {"model": self.model.summary(), "hardware": self.hardware.to_dict(),
                               "workload": _plain(self.workload)}
        for name in self.__dataclass_fields__:
            if name not in out:
                out[name] = _plain(getattr(self, name))
        out["prefill_tok_s"] = self.prefill_tok_s
        out["decode_tok_s_mid"] = self.decode_tok_s_mid
        return out


def estimate(model: ModelSpec, hw: HardwareSpec, workload: Workload) -> Estimate:
    """Predict prefill, decode, memory and batching for `workload` on `hw`."""
    _check_fits_model(model, workload)
    wl, bpe = workload, workload.kv_bytes_per_element
    conc, ctx = wl.concurrency, wl.context_tokens
    steps, memory = _DecodeSteps(model, hw, wl), _Memory(model, hw, wl)
    prefill_s, prefill_flop, prefill_bound = _prefill(model, steps, wl)
    tok_s, bound = steps.reply_rate(conc)
    real = (tok_s * wl.efficiency[0], tok_s * wl.efficiency[1])
    n_steps = max(wl.output_tokens - 1, 0)  # the first token comes out of prefill
    return Estimate(
        model=model, hardware=hw, workload=wl, compute_dtype=steps.dtype,
        prefill_flop=prefill_flop, prefill_flop_per_token=prefill_flop / wl.prompt_tokens,
        prefill_seconds=prefill_s, prefill_bound=prefill_bound, ttft=prefill_s,
        decode_weight_bytes=model.decode_weight_bytes(conc),
        decode_kv_read_bytes=float(np.mean(model.kv_bytes(steps.contexts, bpe))),
        weights_only_tok_s=hw.bandwidth / model.decode_weight_bytes(1),
        decode_tok_s_ceiling=tok_s, decode_tok_s_realistic=real, decode_bound=bound,
        aggregate_tok_s_ceiling=tok_s * conc,
        total_seconds=prefill_s + n_steps / (tok_s * wl.efficiency_mid),
        total_seconds_range=(prefill_s + n_steps / real[1], prefill_s + n_steps / real[0]),
        kv_bytes_per_token=model.kv_bytes_per_token(bpe),
        kv_bytes=conc * float(model.kv_bytes(ctx, bpe)),
        memory_needed=memory.needed(conc, ctx), memory_usable=memory.usable,
        fits=memory.fits(conc, ctx), max_concurrency=memory.max_concurrency(ctx),
        max_context=memory.max_context(conc),
        compute_bound_batch=steps.compute_bound_batch(steps.mid_context),
        batch_sweep=_batch_sweep(steps, memory, wl),
        context_sweep=_context_sweep(steps, memory, wl),
        offload=_offload_effect(model, hw, wl, steps, memory),
        notes=tuple(_notes(model, hw, wl)),
        state_bytes_per_seq=float(model.state_bytes_per_seq()),
        state_bytes=conc * float(model.state_bytes_per_seq()))


class _DecodeSteps:
    """Decode step time at a batch size and context, split over fast and offloaded memory."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, workload: Workload) -> None:
        self.model, self.hw, self.wl = model, hw, workload
        self.dtype = workload.compute_dtype or hw.default_dtype
        self.flop_rate = hw.flop_rate(self.dtype)
        self.slow = slice(0, workload.offload_layers)  # llama.cpp keeps the first layers back
        self.fast = slice(workload.offload_layers, None)
        self.contexts = _reply_contexts(workload)
        self.mid_context = float(np.median(self.contexts))

    def slow_weight_bytes(self, batch: int) -> float:
        """Weight bytes a step reads from the offload memory."""
        return sum(self.model.layer_read_bytes(lyr, batch) for lyr in self.model.layers[self.slow])

    def fast_weight_bytes(self, batch: int) -> float:
        return self.model.decode_weight_bytes(batch) - self.slow_weight_bytes(batch)

    def _fast_seconds(self, batch: int, context: np.ndarray | float
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Fast-memory seconds, compute seconds, and whether KV bytes outweigh weights."""
        m = self.model
        w_fast = self.fast_weight_bytes(batch)
        kv_fast = batch * (np.asarray(m.kv_bytes(context, self.wl.kv_bytes_per_element,
                                                 self.fast), dtype=float)
                           + 2 * m.state_bytes_per_seq(self.fast))  # state read + written
        flop = batch * (m.matmul_flop_per_token() + m.output_flop
                        + np.asarray(m.attention_flop(context), dtype=float))
        return (w_fast + kv_fast) / self.hw.bandwidth, flop / self.flop_rate, kv_fast > w_fast

    def seconds(self, batch: int, context: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """Step seconds and what bounds it per context: "weights" or "kv" (the bytes that
        dominate a bandwidth-bound step), "compute", or "offload" (the slow memory)."""
        memory_s, compute_s, kv_heavy = self._fast_seconds(batch, context)
        seconds = np.maximum(memory_s, compute_s)
        bound = np.where(compute_s > memory_s, "compute", np.where(kv_heavy, "kv", "weights"))
        if self.wl.offload_layers:
            slow_bytes = self.slow_weight_bytes(batch) + batch * (np.asarray(
                self.model.kv_bytes(context, self.wl.kv_bytes_per_element, self.slow),
                dtype=float) + 2 * self.model.state_bytes_per_seq(self.slow))
            slow_s = slow_bytes / self.wl.offload_bandwidth
            bound = np.where(slow_s > seconds, "offload", bound)
            seconds = seconds + slow_s
        return seconds, bound

    def reply_rate(self, batch: int) -> tuple[float, str]:
        """Per-stream tokens/s over the reply and the bound at its middle."""
        seconds, bound = self.seconds(batch, self.contexts)
        return 1.0 / float(np.mean(seconds)), str(bound[len(bound) // 2])

    def compute_bound_batch(self, context: float) -> int | None:
        """Smallest batch whose step is compute-bound at `context` (doubling, then bisection)."""
        def compute_bound(batch: int) -> bool:
            memory_s, compute_s, _ = self._fast_seconds(batch, context)
            return bool(compute_s > memory_s)

        high = 1
        while not compute_bound(high):
            if high >= 1 << 20:
                return None  # KV reads grow as fast as FLOP: bandwidth-bound at any batch
            high *= 2
        low = high // 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if compute_bound(mid) else (mid, high)
        return high


class _Memory:
    """What sits in the fast memory: resident weights plus every sequence's KV cache and
    recurrent state."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, workload: Workload) -> None:
        self.model, self.bpe = model, workload.kv_bytes_per_element
        offloaded = model.layers[:workload.offload_layers]
        self.offloaded_weights = sum(lyr.dense_bytes + lyr.expert_bytes for lyr in offloaded)
        self.resident = model.weight_bytes - self.offloaded_weights
        self.fast = slice(workload.offload_layers, None)
        self.usable = None if hw.memory_bytes is None else hw.memory_bytes * workload.usable_memory

    def kv(self, context: float) -> float:
        """One sequence's cache at `context`: its KV plus its recurrent state."""
        return (float(self.model.kv_bytes(context, self.bpe, self.fast))
                + self.model.state_bytes_per_seq(self.fast))

    def needed(self, concurrency: int, context: int) -> float:
        return self.resident + concurrency * self.kv(context)

    def fits(self, concurrency: int, context: int) -> bool | None:
        return None if self.usable is None else self.needed(concurrency, context) <= self.usable

    def max_concurrency(self, context: int) -> int | None:
        if self.usable is None or self.kv(context) == 0:
            return None if self.usable is None or self.resident <= self.usable else 0
        return max(int((self.usable - self.resident) // self.kv(context)), 0)

    def max_context(self, concurrency: int) -> int | None:
        """Largest context whose KV fits, capped at the model's own limit."""
        if self.usable is None:
            return None
        if self.resident > self.usable:
            return 0
        cap = self.model.max_context or 1 << 31
        if self.needed(concurrency, cap) <= self.usable:
            return self.model.max_context
        low, high = 0, cap  # needed() grows with context: bisect on the last fitting one
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.needed(concurrency, mid) <= self.usable else (low, mid)
        return low


def _prefill(model: ModelSpec, steps: _DecodeSteps, wl: Workload) -> tuple[float, float, str]:
    """Seconds, FLOP and bound of prefilling one prompt alone."""
    p = wl.prompt_tokens
    flop = (p * model.matmul_flop_per_token() + model.prefill_attention_flop(p)
            + wl.logit_positions * model.output_flop)
    kv_written = (p * model.kv_bytes_per_token(wl.kv_bytes_per_element)
                  + model.state_bytes_per_seq())
    memory_s = (steps.fast_weight_bytes(p) + kv_written) / steps.hw.bandwidth
    if wl.offload_layers:
        memory_s += steps.slow_weight_bytes(p) / wl.offload_bandwidth
    compute_s = flop / steps.flop_rate
    return max(compute_s, memory_s), flop, "compute" if compute_s >= memory_s else "memory"


def _reply_contexts(wl: Workload) -> np.ndarray:
    """Cached positions each decode step attends to: prompt + 1 .. prompt + N - 1."""
    first, steps = wl.prompt_tokens + 1, wl.output_tokens - 1
    if steps <= 1:
        return np.array([float(first)])
    return np.linspace(first, first + steps - 1, min(steps, _REPLY_SAMPLES))


def _batch_sweep(steps: _DecodeSteps, memory: _Memory, wl: Workload) -> tuple[BatchPoint, ...]:
    batches = sorted({1 << i for i in range(MAX_SWEEP_BATCH.bit_length())} | {wl.concurrency})
    points = []
    for batch in batches:
        tok_s, bound = steps.reply_rate(batch)
        points.append(BatchPoint(batch, tok_s * batch, tok_s, bound,
                                 memory.fits(batch, wl.context_tokens)))
    return tuple(points)


def _context_sweep(steps: _DecodeSteps, memory: _Memory, wl: Workload
                   ) -> tuple[ContextPoint, ...]:
    top = steps.model.max_context or max(4 * wl.context_tokens, 8192)
    grid = np.unique(np.geomspace(min(128, top), top, 24).astype(int))
    grid = np.unique(np.append(grid, min(wl.context_tokens, top)))
    seconds, _ = steps.seconds(wl.concurrency, grid.astype(float))
    return tuple(
        ContextPoint(int(c), 1.0 / float(s), float(memory.model.kv_bytes(c, memory.bpe)),
                     memory.fits(wl.concurrency, int(c)))
        for c, s in zip(grid, seconds))


def _offload_effect(model: ModelSpec, hw: HardwareSpec, wl: Workload, steps: _DecodeSteps,
                    memory: _Memory) -> OffloadEffect | None:
    if not wl.offload_layers:
        return None
    all_fast = _DecodeSteps(model, hw, replace(wl, offload_layers=0))
    batch, ctx = wl.concurrency, steps.mid_context
    slow_state = model.state_bytes_per_seq(steps.slow)
    slow_kv = model.kv_bytes(ctx, wl.kv_bytes_per_element, steps.slow) + 2 * slow_state
    slow_kv_reserved = (model.kv_bytes(wl.context_tokens, wl.kv_bytes_per_element, steps.slow)
                        + slow_state)
    assert wl.offload_bandwidth is not None
    return OffloadEffect(
        layers=wl.offload_layers, bandwidth=wl.offload_bandwidth,
        slow_bytes_per_step=steps.slow_weight_bytes(batch) + batch * float(slow_kv),
        tok_s_without=all_fast.reply_rate(batch)[0], tok_s_with=steps.reply_rate(batch)[0],
        fast_memory_saved=memory.offloaded_weights + batch * float(slow_kv_reserved))


def _check_fits_model(model: ModelSpec, wl: Workload) -> None:
    if wl.offload_layers and not model.layers_known:
        raise KvlabError("--offload-layers needs the layer count: describe the model with "
                         "--layers N (or pass a GGUF file or config.json)")
    if wl.offload_layers > model.n_layers:
        raise KvlabError(f"--offload-layers {wl.offload_layers} is more than the model's "
                         f"{model.n_layers} layers; valid: 0..{model.n_layers}")
    if model.max_context and wl.context_tokens > model.max_context:
        raise KvlabError(f"context {wl.context_tokens} (prompt + output, or --context) is beyond "
                         f"the model's maximum of {model.max_context} tokens")


def _notes(model: ModelSpec, hw: HardwareSpec, wl: Workload) -> list[str]:
    notes = []
    if not any(layer.kv_elements for layer in model.layers):
        notes.append("KV cache size unknown: describe --layers, --kv-heads and --head-dim")
    elif not any(layer.attn_flop_per_key for layer in model.layers):
        notes.append("attention FLOP not counted: the number of query heads is unknown")
    if model.source == "description" and not model.output_params:
        notes.append("no --vocab/--hidden: every parameter is counted as read and multiplied "
                     "for every token (the 2 x params rule)")
    if model.recurrent_layers:
        notes.append(f"hybrid: {model.recurrent_layers} of {model.n_layers} layers keep a "
                     f"{model.state_bytes_per_seq() / 2**20:.2f} MiB fp32 state per sequence "
                     "instead of KV, read and written once per decode step")
    if model.experts:
        notes.append(f"MoE: {model.experts_used} of {model.experts} experts per token; a batch "
                     "reads the experts its tokens route to (uniform routing assumed)")
    if wl.concurrency > 1:
        notes.append(f"TTFT is one prompt prefilled alone; {wl.concurrency} prompts arriving "
                     "together wait up to that many prefills")
    if hw.memory_bytes is None:
        notes.append("memory size unknown: fit checks skipped (give --memory GiB)")
    return notes


def _plain(value: Any) -> Any:
    """Dataclasses, tuples and numpy scalars as JSON-friendly values."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
