"""`kvlab bench --profile-layers`: a tg test's decode time per token split by layer kind.

The one-call C decode's profile (kvlab.kernels.decode_profile) sums the wall time of each
layer's attention, recurrent mixer, MLP (or experts) and tail (what a layer does after them:
Gemma 4's per-layer input, a layer without a mixer's residual) over the test's decode steps;
the rest of a step, from its inter-token latency, is "head/other": the embedding, the final
norm and output head, sampling, the engine's own work. Speculative decoding is refused: its
verify steps leave the one C call, so a token's time would mix two paths.
A hybrid model's recurrent layers read a state of fixed size, so their time per token should
not grow with depth while the attention layers' does; this split shows each apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine import Engine
from kvlab.harness.llama_bench import BenchResult, bench_tg
from kvlab.kernels import decode_profile

KINDS = ("attention", "recurrent", "mlp", "tail", "head/other")


@dataclass(frozen=True)
class LayerSplit:
    test: str  # the tg test's name: "tg128@d16000"
    depth: int
    steps: int  # decode steps the C call ran (the profile's calls)
    step_ms: float  # a decode token's whole time: 1000 / tok/s over all repetitions
    ms: dict[str, float]  # per decode token, each of KINDS

    def tok_s(self, kind: str) -> float:
        """The kind's share as a rate: tokens per second if the step were that kind alone."""
        return 1e3 / self.ms[kind] if self.ms[kind] > 0 else float("inf")


def profiled_tg(engine: Engine, n_gen: int, reps: int, depth: int = 0,
                bandwidth_gb_s: float | None = None) -> tuple[BenchResult, LayerSplit | None]:
    """bench_tg with the decode profile on; the split is None where no step ran in the one
    C call (a model or step the C decode does not take)."""
    if engine.config.speculative:
        raise ValueError("--profile-layers times plain decode steps; run it without "
                         f"--speculative (got {engine.config.speculative!r})")
    decode_profile.reset()
    decode_profile.enable(True)
    try:
        result = bench_tg(engine, n_gen, reps, depth, bandwidth_gb_s=bandwidth_gb_s)
    finally:
        decode_profile.enable(False)
    return result, split_of(result, decode_profile.read())


def split_of(result: BenchResult, profile: decode_profile.DecodeProfile) -> LayerSplit | None:
    if profile.calls == 0:
        return None
    # each sample is n_gen / (the repetition's summed inter-token latencies)
    step_ms = 1e3 * sum(result.n_gen / s for s in result.samples) / (
        result.n_gen * len(result.samples))
    per_call = profile.per_call_ms()
    layers = {"attention": per_call["attention"], "recurrent": per_call["recurrent"],
              "mlp": per_call["mlp"], "tail": per_call["tail"]}
    other = step_ms - sum(layers.values())
    return LayerSplit(result.test, result.depth, profile.calls, step_ms,
                      {**layers, "head/other": other})


def format_splits(splits: list[LayerSplit]) -> str:
    """ms per decode token by layer kind, one row per tg test."""
    lines = [f"{'test':<16}{'steps':>7}{'step':>9}" + "".join(f"{k:>12}" for k in KINDS)
             + "   (ms per decode token)"]
    for s in splits:
        lines.append(f"{s.test:<16}{s.steps:>7}{s.step_ms:>9.3f}"
                     + "".join(f"{s.ms[k]:>12.3f}" for k in KINDS))
    return "\n".join(lines)
