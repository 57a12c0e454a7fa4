"""Where the milliseconds went: per-generation metrics and the work each phase did.

`RunCost` says what one token costs (weight bytes read by a decode step, FLOP of a
prefill token, KV bytes), read off the model's `kvlab.cost.ModelSpec`;
`GenerationMetrics.from_timings` turns a request's measured
timings into TTFT, tok/s, inter-token latency and the GB/s and FLOP/s each phase reached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvlab.cost import ModelSpec
from kvlab.request import RequestTimings


@dataclass(frozen=True)
class RunCost:
    """What one token of a running engine costs, read off its `ModelSpec` (the estimator's
    vocabulary) at the engine's KV dtype: the figures a run's GB/s and FLOP/s divide."""

    spec: ModelSpec  # the weights as held in memory
    kv_bytes_per_element: float
    window_released: bool = False  # sliding layers keep only their window (a pool apart)
    decode_stored_bytes: int = 0  # decode_weight_bytes as the checkpoint stores the weights

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes a batch-1 decode step reads (of the embedding: one row)."""
        return round(self.spec.decode_weight_bytes(1))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds, all layers (full attention everywhere)."""
        return int(self.spec.kv_bytes_per_token(self.kv_bytes_per_element))

    def kv_bytes_held(self, tokens: int) -> float:
        """KV bytes one sequence of `tokens` holds: every position in full-attention layers;
        in sliding layers the last `window` when their blocks behind it are released."""
        if not self.window_released:
            return float(self.kv_bytes_per_token * tokens)
        return float(self.spec.kv_bytes(tokens, self.kv_bytes_per_element))

    def prefill_flops(self, num_tokens: int, start: int = 0) -> float:
        """FLOP to compute tokens [start, start + n): matmuls, causal attention, one head."""
        return (self.spec.matmul_flop_per_token() * num_tokens + self.spec.output_flop
                + self.spec.chunk_attention_flop(num_tokens, start))

    def prefill_bytes(self, num_tokens: int) -> float:
        """Bytes a prefill of `num_tokens` reads and writes: the weights once (the routed
        experts the tokens pick, one embedding row each) and the KV cache it stores."""
        return (self.spec.decode_weight_bytes(num_tokens)
                + self.kv_bytes_per_token * num_tokens)

    def decode_flops(self, context: int) -> float:
        return (self.spec.matmul_flop_per_token() + self.spec.output_flop
                + float(self.spec.attention_flop(context)))

    def decode_bytes(self, context: int) -> float:
        return self.spec.decode_weight_bytes(1) + float(
            self.spec.kv_bytes(context, self.kv_bytes_per_element))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class GenerationMetrics:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    prefill_s: float
    prefill_tok_s: float
    decode_s: float
    decode_tok_s: float
    itl_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    total_s: float
    kv_tokens: int
    kv_bytes: int
    prefill_gb_s: float
    prefill_gflop_s: float
    decode_gb_s: float
    decode_gflop_s: float

    @classmethod
    def from_timings(cls, t: RequestTimings, cost: RunCost, prompt_tokens: int,
                     cached_tokens: int, output_tokens: int) -> GenerationMetrics:
        itl = t.inter_token_latencies
        end = t.finished or (t.token_times[-1] if t.token_times else t.arrival)
        computed = prompt_tokens - cached_tokens
        prefill_s = t.prefill_seconds
        decode_s = sum(itl)
        steps = len(itl)
        mid_context = prompt_tokens + output_tokens / 2
        kv_tokens = prompt_tokens + max(0, output_tokens - 1)
        return cls(
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            output_tokens=output_tokens, ttft_s=t.ttft or 0.0, prefill_s=prefill_s,
            prefill_tok_s=_rate(computed, prefill_s), decode_s=decode_s,
            decode_tok_s=_rate(steps, decode_s),
            itl_mean_ms=1e3 * decode_s / steps if steps else 0.0,
            itl_p50_ms=1e3 * _percentile(itl, 0.5), itl_p99_ms=1e3 * _percentile(itl, 0.99),
            total_s=end - t.arrival, kv_tokens=kv_tokens,
            kv_bytes=round(cost.kv_bytes_held(kv_tokens)),
            prefill_gb_s=_rate(cost.prefill_bytes(computed), prefill_s) / 1e9,
            prefill_gflop_s=_rate(cost.prefill_flops(computed, cached_tokens), prefill_s) / 1e9,
            decode_gb_s=_rate(steps * cost.decode_bytes(int(mid_context)), decode_s) / 1e9,
            decode_gflop_s=_rate(steps * cost.decode_flops(int(mid_context)), decode_s) / 1e9)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def summary(self) -> str:
        """One screen of text for the terminal."""
        return "\n".join([
            (f"prompt   {self.prompt_tokens} tokens ({self.cached_tokens} from prefix cache), "
             f"output {self.output_tokens} tokens"),
            f"TTFT     {self.ttft_s * 1e3:8.1f} ms",
            (f"prefill  {self.prefill_tok_s:8.1f} tok/s   {self.prefill_gflop_s:7.1f} GFLOP/s  "
             f"{self.prefill_gb_s:6.2f} GB/s   ({self.prefill_s * 1e3:.1f} ms)"),
            (f"decode   {self.decode_tok_s:8.1f} tok/s   {self.decode_gflop_s:7.1f} GFLOP/s  "
             f"{self.decode_gb_s:6.2f} GB/s   ({self.decode_s * 1e3:.1f} ms)"),
            (f"ITL      mean {self.itl_mean_ms:.1f} ms   p50 {self.itl_p50_ms:.1f} ms   "
             f"p99 {self.itl_p99_ms:.1f} ms"),
            f"total    {self.total_s:8.2f} s",
            f"KV cache {self.kv_tokens} tokens, {self.kv_bytes / 2**20:.2f} MiB",
        ])


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0
