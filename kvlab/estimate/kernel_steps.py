"""kvlab's own engine on a probed machine: step times from the kernel rates `kvlab probe`
measured, where the roofline (roofline.py) assumes an engine reaching 60-85 % of the
machine's stream bandwidth.

    decode step = weights + KV + overhead
      weights   = sum over matrices: bytes / read rate of its type + rows x cost per row
                  + product calls x cost per call
      KV        = sum over layers: K/V bytes attended x passes / attention read rate
      overhead  = step + layers x layer + attended positions x position (kvlab's engine on
                  synthetic models of the architecture) + vocab x sampling cost per entry
    prefill     = sum over matrices: 2 x prompt x params / prefill rate of its type
                  + attention FLOP / fp32 FLOP/s, counted as kvlab computes it: every
                    (query, key) pair of the key range, masked afterwards (not half of it)
                  + element-wise passes over every prompt row (norms, RoPE, activation)
                  + the first token's output product and overhead

Every rate is measured with no real model (kvlab.probe.kernels and engine_overhead); the
model contributes only its counted matrices, heads, layers and KV bytes, each matrix as
kvlab's loader holds it (Q8_0, Q5_0, Q4_0, the K-quants and IQ4 in 8-row groups,
`loaded_matrix`).
One sequence and an f32 KV cache, as `kvlab bench` runs it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.cost import MatrixSpec, ModelSpec
from kvlab.estimate.hardware import HardwareSpec, KernelRates, engine_family
from kvlab.estimate.workload import KV_BYTES_PER_ELEMENT, Workload
from kvlab.layouts import GROUPED_BLOCK_BYTES, GROUPS_AS

# query heads kvlab's decode attention serves per pass over a KV head's keys
# (kvlab/kernels/csrc/qk_attn.c: scores and mix take heads four at a time)
ATTENTION_HEADS_PER_PASS = 4
# matrices kvlab's loader joins into one product where neighbours share a storage type
# (kvlab/models/layers.py, Stacked): Gemma 3's q|k|v is one call once all are Q8_0x8
JOINED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
KV_DTYPE = "f32"  # the cache modelled: kvlab bench's default on the CPU (the C attention
# also reads f16, at about half the bytes; not modelled)
_REPLY_SAMPLES = 512  # decode steps sampled across a reply: step time is piecewise linear


@dataclass(frozen=True)
class DecodeTerms:
    """Seconds of one decode step, by what they are spent on."""

    weights: float  # streaming every matrix through the products
    kv: float  # decode attention reading the K/V cache
    overhead: float  # the engine's calls (per step, layer, attended position), sampling

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.overhead

    def shares(self) -> dict[str, float]:
        return {"weights": self.weights / self.total, "KV": self.kv / self.total,
                "overhead": self.overhead / self.total}


@dataclass(frozen=True)
class PrefillTerms:
    """Seconds of prefilling one prompt alone, by what they are spent on."""

    matmul: float  # the integer products over every prompt row
    attention: float  # masked attention over the key range (fp32, torch)
    row_ops: float  # element-wise passes over every prompt row: norms, RoPE, activation
    first_token: float  # output product, sampling and per-layer calls of the last position

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.row_ops + self.first_token

    def shares(self) -> dict[str, float]:
        return {"matmul": self.matmul / self.total, "attention": self.attention / self.total,
                "element-wise": self.row_ops / self.total,
                "first token": self.first_token / self.total}


@dataclass(frozen=True)
class KvlabPrediction:
    workload: Workload
    prefill: PrefillTerms
    decode: DecodeTerms  # mean step over the reply
    decode_first: DecodeTerms  # the reply's first and last steps
    decode_last: DecodeTerms
    steps_from: str = ""  # the model whose whole steps scaled the terms; "": kernels alone

    @property
    def ttft(self) -> float:
        return self.prefill.total

    @property
    def prefill_tok_s(self) -> float:
        return self.workload.prompt_tokens / self.prefill.total

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.decode.total

    @property
    def total_seconds(self) -> float:
        return self.ttft + max(self.workload.output_tokens - 1, 0) * self.decode.total

    def to_dict(self) -> dict[str, Any]:
        return {"ttft": self.ttft, "prefill_tok_s": self.prefill_tok_s,
                "decode_tok_s": self.decode_tok_s, "total_seconds": self.total_seconds,
                "prefill_seconds": asdict(self.prefill), "decode_step_seconds": asdict(self.decode),
                "decode_first_step_seconds": asdict(self.decode_first),
                "decode_last_step_seconds": asdict(self.decode_last)}

    def format(self) -> str:
        """Terminal lines, in the layout of `kvlab estimate`'s report."""
        d, n = self.decode, max(self.workload.output_tokens - 1, 0)
        prefill = shares_text(self.prefill.shares())
        step = (f"{shares_text(d.shares())}; KV {_secs(self.decode_first.kv)} at the first "
                f"step, {_secs(self.decode_last.kv)} at the last")
        how = (f"scaled to whole steps timed on a replica of {self.steps_from}"
               if self.steps_from else "one sequence")
        head = (f"kvlab     kvlab's own engine here: the probed rates of its kernels and engine, "
                f"{how}, {self.workload.kv_dtype} KV cache")
        lines = [head,
                 f"          prefill {self.prefill_tok_s:,.0f} tok/s, TTFT {_secs(self.ttft)} "
                 + f"({prefill})",
                 f"          decode {self.decode_tok_s:,.1f} tok/s, a {_secs(d.total)} step "
                 + f"({step})",
                 f"          total TTFT + {n:,} steps = {_secs(self.total_seconds)}", ""]
        return "\n".join(lines)


def shares_text(shares: dict[str, float]) -> str:
    """{"weights": 0.7, "KV": 0.1, ...} -> 'weights 70%, ...', largest first."""
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {share:.0%}" for name, share in ranked)


def _secs(value: float) -> str:
    return f"{value:,.2f} s" if value >= 0.1 else f"{value * 1e3:,.2f} ms"


def unsupported_reason(model: ModelSpec, hw: HardwareSpec) -> str | None:
    """Why kvlab's step model can not predict `model` on `hw`; None when it can."""
    if hw.kernels is None or not hw.kernels.layer_seconds:
        return (f"{hw.name} has no measured kvlab kernel rates: they come from `kvlab probe` "
                "(--hardware this)")
    if model.output_matrix is None or not all(lyr.matrices for lyr in model.layers):
        return "the model's weight matrices are unknown: pass a GGUF file"
    if any(lyr.kv_elements and not lyr.kv_heads for lyr in model.layers):
        return "the model's KV heads are unknown"
    if not model.hidden_size:
        return "the model's hidden size is unknown"
    return None


def product_calls(matrices: tuple[MatrixSpec, ...]) -> int:
    """C product calls one decode step makes for a block's matrices (see JOINED)."""
    by_name = {m.name: m.qtype for m in matrices}
    calls = len(matrices)
    for group in JOINED:
        types = [by_name[name] for name in group if name in by_name]
        calls -= sum(a == b for a, b in pairwise(types))
    return calls


def loaded_matrix(m: MatrixSpec) -> MatrixSpec:
    """`m` as kvlab's loader holds it on the CPU: GGUF types with 8-row group kernels, in a
    multiple of 8 rows, become Q8_0x8 / Q4_Kx8 / Q5_Kx8 / Q6_Kx8 / IQ4_XSx8 / ... with their
    bytes (Q4_0 widens to 8 bits; the others keep their file type's size)."""
    qtype = GGMLQuantizationType.__members__.get(m.qtype)
    if qtype not in GROUPS_AS or m.rows % 8:
        return m
    grouped = GROUPS_AS[qtype]
    widen = GROUPED_BLOCK_BYTES[grouped] / GGML_QUANT_SIZES[qtype][1]  # same block length
    return MatrixSpec(f"{grouped.name}x8", m.rows, m.cols, round(m.nbytes * widen), m.name)


def reply_contexts(wl: Workload) -> list[int]:
    """Cached positions each decode step attends to: prompt + 1 .. prompt + output - 1."""
    first, n = wl.prompt_tokens + 1, max(wl.output_tokens - 1, 1)
    return sorted({int(c) for c in np.linspace(first, first + n - 1, min(n, _REPLY_SAMPLES))})


class StepCosts:
    """A model's matrices, layers and heads over the probed kernel rates: seconds by term."""

    def __init__(self, model: ModelSpec, rates: KernelRates) -> None:
        self.model, self.rates = model, rates
        self.layer_matrices = [tuple(map(loaded_matrix, lyr.matrices)) for lyr in model.layers]
        self.matrices = [m for mats in self.layer_matrices for m in mats]
        assert model.output_matrix is not None
        self.output = loaded_matrix(model.output_matrix)

    def read_seconds(self, m: MatrixSpec) -> float:
        """A batch-1 product through `m`, less its call cost."""
        return m.nbytes / self.rates.weight_rate(m.qtype) + m.rows * self.rates.row_cost(m.qtype)

    def weights_seconds(self) -> float:
        calls = sum(map(product_calls, self.layer_matrices)) + 1
        return (sum(map(self.read_seconds, self.matrices)) + self.read_seconds(self.output)
                + calls * self.rates.call_seconds)

    def overhead(self, context: float) -> float:
        m = self.model
        step, layer, position = self.rates.engine(m.architecture)
        attended = max(float(lyr.attended(context)) for lyr in m.layers)
        vocab = m.vocab_size or self.output.rows
        return (step + m.n_layers * layer + attended * position
                + vocab * self.rates.logit_seconds)

    def kv_seconds(self, context: float) -> float:
        bpe = KV_BYTES_PER_ELEMENT[KV_DTYPE]
        seconds = 0.0
        for lyr in self.model.layers:
            if not lyr.kv_elements:
                continue
            passes = math.ceil(lyr.heads / lyr.kv_heads / ATTENTION_HEADS_PER_PASS)
            kv_bytes = bpe * lyr.kv_elements * float(lyr.attended(context))
            seconds += passes * kv_bytes / self.rates.attention_rate(lyr.kv_heads)
        return seconds

    def decode(self, context: float) -> DecodeTerms:
        return DecodeTerms(self.weights_seconds(), self.kv_seconds(context),
                           self.overhead(context))

    def prefill(self, prompt: int, fp32_rate: float) -> PrefillTerms:
        matmul = sum(2.0 * prompt * m.rows * m.cols / self.rates.prefill_rate(m.qtype)
                     for m in self.matrices)
        attention = self.prefill_attention_flop(prompt) / fp32_rate
        first = self.read_seconds(self.output) + self.rates.call_seconds + self.overhead(prompt)
        return PrefillTerms(matmul, attention, prompt * self.row_op_seconds(), first)

    def prefill_attention_flop(self, prompt: int) -> float:
        """FLOP of kvlab's prefill attention over one chunk holding the whole prompt: each
        query meets every key from the chunk's first visible key on (the first key for a
        fresh prompt) and the causal and window masks apply after, so P x P pairs."""
        return float(sum(lyr.attn_flop_per_key for lyr in self.model.layers)) * prompt * prompt

    def row_op_seconds(self) -> float:
        """Element-wise seconds per prompt row, all layers: four hidden-wide passes (norms
        and residuals), norm + RoPE over the q and k heads, the gated activation."""
        ops, m = self.rates.row_op_seconds, self.model
        activation = ops["gelu" if engine_family(m.architecture) == "gemma3" else "silu"]
        seconds = 0.0
        for lyr in m.layers:
            head_dim = lyr.kv_elements // (2 * lyr.kv_heads) if lyr.kv_heads else 0
            seconds += (4 * (m.hidden_size or 0) * ops["norm"]
                        + (lyr.heads + lyr.kv_heads) * head_dim * ops["rope"]
                        + lyr.ffn_width * activation)
        return seconds
