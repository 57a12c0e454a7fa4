"""What a model costs per token: bytes read, bytes of KV cache stored, FLOP computed.

A `ModelSpec` is the model as the roofline sees it: per-layer weight bytes and matmul
parameters, per-layer KV width and attention window, and the tables outside the layers
(embedding lookups read one row per token, the output projection is read in full every
decode step and multiplied only at positions whose logits are needed), and the fixed-size
state a hybrid's recurrent layers keep per sequence instead of KV (resident whatever the
context, read and written once per decode step). It is the one
vocabulary of cost in kvlab: the estimator predicts from it, and the engine's metrics read
the GB/s and FLOP/s a run reached from it. Builders for GGUF files, HF config.json and bare
descriptions live in `kvlab.estimate.specs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# bytes of one cached K or V value, by KV cache dtype: the stores' layouts (q8_0: 32 int8
# values and one f16 scale per block), read by the engine's pool sizing and the estimator
KV_BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}


@dataclass(frozen=True)
class MatrixSpec:
    """One stored weight matrix: what a product through it reads and multiplies."""

    qtype: str  # GGML type name: "Q8_0", "Q4_K", "F32", ...
    rows: int  # output features
    cols: int  # input features
    nbytes: int
    name: str = ""  # role in its block, as GGUF names it: "attn_q", "ffn_down", ...


@dataclass(frozen=True)
class LayerSpec:
    """One transformer block. Expert fields cover all routed experts of an MoE block."""

    dense_bytes: int  # weights every token reads: attention, norms, dense or shared FFN
    dense_params: int  # matmul parameters among them (2 FLOP each per token)
    kv_elements: int = 0  # K+V values stored per token: kv_heads x (key_dim + value_dim)
    attn_flop_per_key: int = 0  # 2 x heads x (key_dim + value_dim): QK^T and AV, one position
    window: int | None = None  # sliding-window length; None: full attention
    expert_bytes: int = 0
    expert_params: int = 0
    heads: int = 0  # query heads (0: unknown)
    kv_heads: int = 0
    ffn_width: int = 0  # width of the gated activation (intermediate size; 0: unknown)
    matrices: tuple[MatrixSpec, ...] = ()  # the dense weight matrices, where the file says
    # a recurrent layer's state per sequence (fp32 conv + SSM / delta-rule state): held for
    # the sequence's life whatever its length, read and written once per decode step; 0: an
    # attention layer
    state_bytes: int = 0

    def attended(self, context: np.ndarray | float) -> np.ndarray | float:
        """Cached positions this layer keeps and reads at `context` tokens."""
        return context if self.window is None else np.minimum(context, self.window)


@dataclass(frozen=True)
class ModelSpec:
    """A model as bytes and FLOP. `kvlab.estimate.specs` builds one from a GGUF file, an HF
    config.json or a bare description; `LoadedModel.model_spec` from a model kvlab has loaded."""

    name: str
    source: str  # "gguf", "hf-config", "description" or "loaded"
    n_params: int
    weight_bytes: int  # every stored weight: what must sit in memory
    layers: tuple[LayerSpec, ...]
    lookup_params: int = 0  # embedding tables (token, position): one row read per token
    lookup_row_bytes: int = 0  # bytes of one row of each lookup table, summed
    output_params: int = 0  # vocab x hidden: 2 FLOP each per position that needs logits
    output_bytes: int = 0  # read in full every decode step (tied: the embedding table)
    other_bytes: int = 0  # norms and other small tensors outside the blocks
    experts: int = 0  # routed experts per MoE block (0: dense model)
    experts_used: int = 0  # experts each token is routed to
    max_context: int | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    layers_known: bool = True  # False: a bare description, all weights in one pseudo-layer
    tied_output: bool = False
    output_matrix: MatrixSpec | None = None  # as stored, where the file says (GGUF)
    architecture: str = ""  # "llama", "gemma3", ... where the file says

    # -- what one token costs ---------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts it does not pick."""
        routed = sum(lyr.expert_params for lyr in self.layers)
        return self.n_params - round(routed * (1 - self.expert_fraction(1)))

    @property
    def embedding_share(self) -> float:
        return self.lookup_params / self.n_params if self.n_params else 0.0

    def expert_fraction(self, tokens: int) -> float:
        """Share of routed experts a step over `tokens` tokens reads, routing uniform."""
        return expert_share(self.experts_used, self.experts, tokens)

    def layer_read_bytes(self, layer: LayerSpec, tokens: int = 1) -> float:
        return layer.dense_bytes + layer.expert_bytes * self.expert_fraction(tokens)

    def decode_weight_bytes(self, batch: int = 1) -> float:
        """Weight bytes one decode step over `batch` sequences reads from memory."""
        blocks = sum(self.layer_read_bytes(layer, batch) for layer in self.layers)
        return blocks + self.other_bytes + self.output_bytes + batch * self.lookup_row_bytes

    def matmul_flop_per_token(self) -> float:
        """Block matmul FLOP for one token (routed experts: only the used ones)."""
        used = self.experts_used / self.experts if self.experts else 1.0
        return 2.0 * sum(lyr.dense_params + lyr.expert_params * used for lyr in self.layers)

    @property
    def output_flop(self) -> float:
        """FLOP of the output projection for one position whose logits are needed."""
        return 2.0 * self.output_params

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV bytes one token adds with full attention everywhere (no window cap)."""
        return bytes_per_element * sum(layer.kv_elements for layer in self.layers)

    def kv_split(self, bytes_per_element: float) -> tuple[float, float]:
        """(bytes per token of the full-attention layers, fixed bytes of the sliding layers'
        windows): what one long sequence holds once its windows are full."""
        full = sum(lyr.kv_elements for lyr in self.layers if lyr.window is None)
        fixed = sum(lyr.kv_elements * lyr.window for lyr in self.layers if lyr.window)
        return bytes_per_element * full, bytes_per_element * fixed

    def state_bytes_per_seq(self, layers: slice = slice(None)) -> int:
        """Recurrent-state bytes one sequence holds, whatever its context."""
        return sum(layer.state_bytes for layer in self.layers[layers])

    @property
    def recurrent_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.state_bytes)

    def kv_bytes(self, context: np.ndarray | float, bytes_per_element: float,
                 layers: slice = slice(None)) -> np.ndarray | float:
        """KV bytes one sequence holds (and a decode step reads) at `context` tokens."""
        return bytes_per_element * sum(
            layer.kv_elements * layer.attended(context) for layer in self.layers[layers])

    def attention_flop(self, context: np.ndarray | float) -> np.ndarray | float:
        """Attention FLOP for one new token that attends to `context` positions."""
        return sum(layer.attn_flop_per_key * layer.attended(context) for layer in self.layers)

    def chunk_attention_flop(self, tokens: int, start: int = 0) -> float:
        """Causal attention FLOP of positions [start, start + tokens) over the cache."""
        return float(sum(layer.attn_flop_per_key * (causal_span_sum(start + tokens, layer.window)
                                                    - causal_span_sum(start, layer.window))
                         for layer in self.layers))

    def prefill_attention_flop(self, prompt_tokens: int) -> float:
        """Causal attention FLOP over a prompt: position i attends min(i, window) keys."""
        return float(sum(layer.attn_flop_per_key * causal_span_sum(prompt_tokens, layer.window)
                         for layer in self.layers))

    def summary(self) -> dict[str, Any]:
        """The figures a report shows, JSON-friendly."""
        windows = [lyr.window for lyr in self.layers if lyr.window is not None]
        return {"name": self.name, "source": self.source, "params": self.n_params,
                "weight_bytes": self.weight_bytes,
                "bits_per_param": 8 * self.weight_bytes / self.n_params,
                "embedding_share": self.embedding_share,
                "decode_weight_bytes": self.decode_weight_bytes(1),
                "layers": self.n_layers if self.layers_known else None,
                "sliding_window": max(windows) if windows else None,
                "sliding_layers": len(windows), "experts": self.experts,
                "experts_used": self.experts_used, "active_params": self.active_params,
                "max_context": self.max_context,
                "recurrent_layers": self.recurrent_layers,
                "state_bytes_per_seq": self.state_bytes_per_seq(),
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "tied_output": self.tied_output}


def expert_share(used: int, experts: int, tokens: int) -> float:
    """Expected share of distinct experts `tokens` tokens route to, each picking `used` of
    `experts` uniformly: 1 - (1 - used / experts) ** tokens (batch 1: used / experts)."""
    if not experts:
        return 1.0
    return 1.0 - (1.0 - used / experts) ** max(tokens, 1)


def causal_span_sum(tokens: int, window: int | None) -> int:
    """sum over positions i = 1..tokens of min(i, window): keys attended in a causal prefill.

        window 3, tokens 5:   i = 1 2 3 4 5
                              keys 1 2 3 3 3   -> 12
    """
    if tokens <= 0:
        return 0
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window
