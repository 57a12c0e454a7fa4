"""Prometheus metrics of the server, written by hand in the text exposition format (0.0.4).

Names follow vLLM's (`vllm:` becomes `kvlab:`), so a vLLM Grafana dashboard reads them with a
prefix change. Per-request histograms are filled when a request finishes or is aborted; the
gauges are read from the engine's stats snapshot when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from kvlab.engine import EngineStats
from kvlab.request import RequestOutput
from kvlab.spec.stats import SpecCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

ACCEPTANCE_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)  # tokens


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    esc = {k: v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
           for k, v in pairs.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _header(name: str, help_: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]


@dataclass
class Counter:
    name: str  # ends in _total
    help: str
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self, base: dict[str, str]) -> list[str]:
        lines = _header(self.name, self.help, "counter")
        values = self.values or {(): 0.0}
        for key, v in sorted(values.items()):
            lines.append(f"{self.name}{_labels({**base, **dict(key)})} {_num(v)}")
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, base: dict[str, str]) -> list[str]:
        lines = _header(self.name, self.help, "histogram")
        cumulative = 0
        for le, n in zip((*self.buckets, math.inf), self.counts):
            cumulative += n
            lines.append(f"{self.name}_bucket{_labels({**base, 'le': _num(le)})} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(base)} {_num(self.total)}")
        lines.append(f"{self.name}_count{_labels(base)} {self.count}")
        return lines


def _gauge(name: str, help_: str, value: float, base: dict[str, str]) -> list[str]:
    return [*_header(name, help_, "gauge"), f"{name}{_labels(base)} {_num(value)}"]


def _total(name: str, help_: str, value: float, base: dict[str, str]) -> list[str]:
    """A counter the engine keeps itself (read from its stats at scrape time)."""
    return [*_header(name, help_, "counter"), f"{name}{_labels(base)} {_num(value)}"]


def speculative_lines(counts: SpecCounts, base: dict[str, str]) -> list[str]:
    """Speculative decoding's counters, and its acceptance lengths (proposals kept per
    verify run) as a histogram."""
    lengths = Histogram("kvlab:spec_decode_acceptance_length",
                        "Proposed tokens accepted per verify run of a sequence.",
                        ACCEPTANCE_BUCKETS)
    for n, runs in counts.lengths.items():
        lengths.counts[bisect.bisect_left(ACCEPTANCE_BUCKETS, n)] += runs
        lengths.total += n * runs
        lengths.count += runs
    return [*_total("kvlab:spec_decode_num_drafts_total",
                    "Verify runs: a sequence's proposals checked in one step.", counts.runs,
                    base),
            *_total("kvlab:spec_decode_num_draft_tokens_total", "Tokens proposed.",
                    counts.drafted, base),
            *_total("kvlab:spec_decode_num_accepted_tokens_total",
                    "Proposed tokens the model accepted.", counts.accepted, base),
            *lengths.render(base)]


class ServerMetrics:
    """Everything /metrics reports. Touched only from the event loop thread."""

    def __init__(self, model_name: str) -> None:
        self.base = {"model_name": model_name}
        h = Histogram
        self.ttft = h("kvlab:time_to_first_token_seconds",
                      "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = h("kvlab:inter_token_latency_seconds",
                     "Time between successive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = h("kvlab:e2e_request_latency_seconds",
                     "Time from request arrival to its last token.", REQUEST_BUCKETS)
        self.queue = h("kvlab:request_queue_time_seconds",
                       "Time a request waited before its first scheduled step.", REQUEST_BUCKETS)
        self.prefill = h("kvlab:request_prefill_time_seconds",
                         "Time of the steps that computed a request's prompt.", REQUEST_BUCKETS)
        self.decode = h("kvlab:request_decode_time_seconds",
                        "Time from a request's first token to its last.", REQUEST_BUCKETS)
        self.prompt_tokens = Counter("kvlab:prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter("kvlab:generation_tokens_total",
                                         "Tokens generated.")
        self.cached_tokens = Counter("kvlab:prompt_tokens_cached_total",
                                     "Prompt tokens served from the prefix cache.")
        self.requests = Counter("kvlab:request_success_total",
                                "Finished requests, by finish reason.")
        self.rejected = Counter("kvlab:request_rejected_total",
                                "Requests refused because the waiting queue was full.")

    def observe(self, out: RequestOutput, arrival: float, reason: str) -> None:
        """Account one finished (or aborted) request from its last output."""
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.output_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        self.requests.inc(finished_reason=reason)
        t = out.timings
        if t is None:
            return
        if t.first_token is not None:
            self.ttft.observe(t.first_token - arrival)
            self.decode.observe((t.finished or t.token_times[-1]) - t.first_token)
        if t.scheduled is not None:
            self.queue.observe(max(0.0, t.scheduled - arrival))
            self.prefill.observe(t.prefill_seconds)
        for gap in t.inter_token_latencies:
            self.itl.observe(gap)
        if t.finished is not None:
            self.e2e.observe(t.finished - arrival)

    def render(self, stats: EngineStats) -> str:
        b = self.base
        hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        lines = [
            *_gauge("kvlab:num_requests_running", "Requests in the running batch.",
                    stats.num_running, b),
            *_gauge("kvlab:num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting, b),
            *_gauge("kvlab:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                    stats.kv_usage, b),
            *_gauge("kvlab:kv_cache_blocks_used", "KV cache blocks in use.",
                    stats.kv_blocks_used, b),
            *_gauge("kvlab:kv_cache_blocks_total", "KV cache blocks in the pool.",
                    stats.kv_blocks_total, b),
            *_gauge("kvlab:prefix_cache_hit_rate",
                    "Prompt tokens found in the prefix cache / tokens looked up (0-1).",
                    hit_rate, b),
            *_total("kvlab:prefix_cache_queries_total",
                    "Prompt tokens looked up in the prefix cache.", stats.prefix_queries, b),
            *_total("kvlab:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                    stats.prefix_hits, b),
            *speculative_lines(stats.speculative, b),
        ]
        for metric in (self.prompt_tokens, self.generation_tokens, self.cached_tokens,
                       self.requests, self.rejected, self.ttft, self.itl, self.e2e,
                       self.queue, self.prefill, self.decode):
            lines += metric.render(b)
        return "\n".join(lines) + "\n"
