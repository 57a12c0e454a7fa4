"""Where the milliseconds went: per-generation metrics and the work each phase did.

`ModelCost` says what one token costs (weight bytes read by a decode step, FLOP of a
prefill token, KV bytes); `GenerationMetrics.from_timings` turns a request's measured
timings into TTFT, tok/s, inter-token latency and the GB/s and FLOP/s each phase reached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvlab.request import RequestTimings


@dataclass(frozen=True)
class ModelCost:
    decode_weight_bytes: int  # weight bytes one decode step reads (embedding: one row)
    decode_stored_bytes: int  # the same weights as the checkpoint stores them
    matmul_params: int  # weights multiplied per token, output projection excluded
    head_params: int  # output projection (vocab x hidden), run once per sampled position
    kv_bytes_per_token: int  # stored per token, all layers
    attn_flops_per_key: int  # 4 * layers * heads * head_dim: QK^T and PV per (query, key)
    sliding_layer_share: float = 0.0  # layers that only read their last `window` keys
    window: int | None = None
    # mixture of experts: the routed experts' weights, all of them (decode_weight_bytes and
    # matmul_params hold the share one token reads: experts_used / experts)
    routed_bytes: int = 0
    experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_used: int = 0  # chosen per token
    # the sliding layers keep only their window (a pool of their own); False: every position
    window_released: bool = False

    def decode_weight_bytes_at(self, batch: int) -> float:
        """Weight bytes a decode step over `batch` sequences reads: the routed experts at the
        expected share of distinct ones the batch picks, everything else once."""
        if not self.experts:
            return float(self.decode_weight_bytes)
        extra = expert_share(self.experts_used, self.experts, batch) - \
            self.experts_used / self.experts
        return self.decode_weight_bytes + self.routed_bytes * extra

    def keys_read(self, context: int) -> float:
        """Keys a decode step reads, averaged over layers (sliding layers cap at the window)."""
        capped = min(context, self.window) if self.window else context
        return (1 - self.sliding_layer_share) * context + self.sliding_layer_share * capped

    def kv_bytes_held(self, tokens: int) -> float:
        """KV bytes one sequence of `tokens` holds: every position in full-attention layers;
        in sliding layers the last `window` when their blocks behind it are released."""
        if not self.window_released:
            return float(self.kv_bytes_per_token * tokens)
        return self.kv_bytes_per_token * self.keys_read(tokens)

    def prefill_flops(self, num_tokens: int, start: int = 0) -> float:
        """FLOP to compute tokens [start, start + n): matmuls, causal attention, one head."""
        keys = sum(start + i + 1 for i in range(num_tokens))
        return 2.0 * self.matmul_params * num_tokens + self.attn_flops_per_key * keys \
            + 2.0 * self.head_params

    def decode_flops(self, context: int) -> float:
        return 2.0 * (self.matmul_params + self.head_params) + \
            self.attn_flops_per_key * self.keys_read(context)

    def decode_bytes(self, context: int) -> float:
        return self.decode_weight_bytes + self.kv_bytes_per_token * self.keys_read(context)


def expert_share(used: int, experts: int, tokens: int) -> float:
    """Expected share of distinct experts `tokens` tokens route to, each picking `used` of
    `experts` uniformly: 1 - (1 - used / experts) ** tokens (batch 1: used / experts)."""
    if not experts:
        return 1.0
    return 1.0 - (1.0 - used / experts) ** max(tokens, 1)


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
    def from_timings(cls, t: RequestTimings, cost: ModelCost, prompt_tokens: int,
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
            prefill_gb_s=_rate(cost.decode_weight_bytes_at(computed)
                               + cost.kv_bytes_per_token * computed,
                               prefill_s) / 1e9,
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
