"""ModelConfig: the shape of a transformer, built once from checkpoint metadata and frozen.

Stdlib only. Each architecture file in kvlab/models turns GGUF metadata or an HF
config.json into one of these; everything downstream reads it and never mutates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LongRope:
    """Phi-3's "longrope": per-frequency divisors, one set below `original` positions and one
    from there on, and cos/sin scaled by `attention_factor`. GGUF stores the two sets as
    tensors (rope_factors_short/long), HF in the config (None here until the loader has them)."""

    original: int  # original_max_position_embeddings: where the long factors start
    attention_factor: float
    short: tuple[float, ...] | None = None  # [head_dim / 2] each
    long: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Yarn:
    """YaRN: frequencies interpolated by `factor` below a ramp between the dimensions that
    turn `beta_fast` and `beta_slow` times over `original` positions, kept above it; cos/sin
    scaled by `attention_factor` (0.1 ln(factor) + 1 unless the checkpoint gives one).
    `truncate`: the ramp's ends rounded to whole dimensions (false for gpt-oss)."""

    factor: float
    original: int  # original_max_position_embeddings
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a scaling factor: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # llama3 frequency scaling (Llama 3.1/3.2): None or a tuple
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    llama3: tuple[float, float, float, int] | None = None
    linear_factor: float = 1.0  # positions divided by this ("linear" rope scaling)
    longrope: LongRope | None = None
    yarn: Yarn | None = None
    # share of each head's dimensions that rotate (GLM-4.5: 0.5); the others pass unchanged
    partial: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token runs `experts_per_token` of `num_experts`."""

    num_experts: int
    experts_per_token: int  # top-k of the router's softmax
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the k chosen probabilities to sum to 1
    shared_intermediate_size: int = 0  # an expert every token runs (Qwen2-MoE); 0: none
    # "softmax" over all experts, or "sigmoid" per expert with a per-expert bias added for
    # the choice only (DeepSeek-V3's noaux_tc, GLM-4.5), or "topk_softmax": the top k of the
    # router's logits (with its bias), softmax over those k (gpt-oss)
    scoring: str = "softmax"
    # experts in this many groups, the best `top_groups` kept: sigmoid ranks a group by its
    # two best biased scores, softmax (DeepSeek-V2's group_limited_greedy) by its best one
    groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0  # the chosen experts' weights multiplied by this
    # (alpha, limit) of gpt-oss's clamped SwiGLU experts (moe.ClampedSwiglu); None: SwiGLU
    swiglu_clamp: tuple[float, float] | None = None


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent of
    `kv_lora_rank` values per token (after its norm) plus a rotary key part of
    `qk_rope_head_dim` shared by all heads; the cache keeps those two, not per-head K/V.
    Each head's query is `qk_nope_head_dim` (matched against the latent through W_UK) plus
    `qk_rope_head_dim` (rotated) values; its value is `v_head_dim` wide."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q is one product of the hidden state

    @property
    def latent_width(self) -> int:
        """Values one token keeps per layer: the latent then its rotary key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent layers of a hybrid model (layer type "recurrent"): each keeps a state of
    fixed size per sequence, fp32, in place of KV. Every kind has a causal depthwise
    convolution whose state is its last K - 1 inputs; Gated DeltaNet adds a matrix per value
    head."""

    # "short_conv" (LFM2), "gated_delta" (Qwen3.5's Gated DeltaNet) or "mamba2" (Granite 4
    # hybrid, Nemotron-H)
    kind: str
    conv_kernel: int  # K, the convolution's width
    conv_channels: int  # C, its channels
    num_k_heads: int = 0  # gated_delta: query/key heads, value heads and their widths
    num_v_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    # value head j reads key head j % Hk (llama.cpp's GGUF order) instead of j // (Hv / Hk)
    v_heads_tiled: bool = False
    # mamba2: SSM heads x ssm_head_dim (d_inner), B and C in ssm_groups groups of
    # ssm_state_size each; dt clamped to time_step_limit
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_groups: int = 0
    ssm_state_size: int = 0
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_channels)

    @property
    def recurrent_state_shape(self) -> tuple[int, ...] | None:
        """One sequence's delta-rule state [Hv, Dk, Dv]; None for a short convolution."""
        if self.kind == "mamba2":  # the SSM state [H, P, N]
            return (self.ssm_heads, self.ssm_head_dim, self.ssm_state_size)
        if self.kind != "gated_delta":
            return None
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    @property
    def state_elements(self) -> int:
        """fp32 elements one sequence's state takes in one recurrent layer."""
        rec = self.recurrent_state_shape
        rec_size = rec[0] * rec[1] * rec[2] if rec else 0
        return (self.conv_kernel - 1) * self.conv_channels + rec_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    local_rope: RopeConfig | None = None  # rope of sliding-window layers when it differs
    sliding_window: int | None = None
    # per layer: "full" or "sliding" (attention), "recurrent" (a state per sequence, no KV),
    # or "mlp" (no token mixing: the layer is its MLP alone, neither KV nor state)
    layer_types: tuple[str, ...] = ()
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm on each head's queries and keys
    qk_norm_whole: bool = False  # RMSNorm over all heads' queries (keys) as one vector (OLMoE)
    attn_scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    moe: MoeConfig | None = None  # None: a dense MLP in every layer
    name: str = ""
    # False: bidirectional attention over the whole input, an encoder (BERT) that only embeds
    causal: bool = True
    recurrent: RecurrentConfig | None = None  # the "recurrent" layers' state, if any
    no_rope_layers: tuple[bool, ...] = ()  # per layer: True where it has no RoPE (SmolLM3)
    # (beta, original): queries scaled by 1 + beta * ln(1 + floor(position / original))
    # (Mistral 3's llama_4_scaling); None: no scaling
    query_temperature: tuple[float, int] | None = None
    # Granite's multipliers: embeddings times embedding_scale, each mixer's and MLP's
    # output times residual_scale before its residual add, logits divided by logit_scale
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    mla: MlaConfig | None = None  # latent attention: the cache keeps the latent
    # full-attention layers' own head size and KV heads where they differ from head_dim /
    # num_kv_heads (Gemma 4); 0: the same as every layer's
    global_head_dim: int = 0
    global_kv_heads: int = 0
    # per layer: the layer whose K/V it attends over; a layer that reads an earlier one's
    # writes none of its own and has no store (Gemma 4's KV sharing); (): each its own
    kv_sources: tuple[int, ...] = ()
    # full-attention layers have no v projection: values are their keys (Gemma 4)
    global_values_from_keys: bool = False
    # True: each attention or recurrent layer runs an MLP after its mixer; False: those
    # layers run their mixer alone and the MLPs are layers of their own (Nemotron-H)
    mlp_after_mixer: bool = True

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def no_rope(self, layer: int) -> bool:
        return bool(self.no_rope_layers) and self.no_rope_layers[layer]

    def second_rope(self, layer: int) -> bool:
        """Whether the layer takes the second RoPE table: none (identity) on a layer without
        RoPE where some have none, else local_rope (or the same rope) on a sliding layer."""
        if self.no_rope_layers:
            return self.no_rope(layer)
        return self.is_sliding(layer)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding" and self.sliding_window is not None

    @property
    def num_sliding_layers(self) -> int:
        return sum(map(self.is_sliding, range(self.num_layers)))

    def layer_head_dim(self, layer: int) -> int:
        full = self.layer_types[layer] == "full"
        return self.global_head_dim if full and self.global_head_dim else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        full = self.layer_types[layer] == "full"
        return self.global_kv_heads if full and self.global_kv_heads else self.num_kv_heads

    def values_from_keys(self, layer: int) -> bool:
        return self.global_values_from_keys and self.layer_types[layer] == "full"

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    def owns_kv(self, layer: int) -> bool:
        """Whether the layer keeps a K/V store: attention that reads no other layer's."""
        return self.is_attention(layer) and self.kv_source(layer) == layer

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] in ("full", "sliding")

    def is_recurrent(self, layer: int) -> bool:
        return self.layer_types[layer] == "recurrent"

    def has_mlp(self, layer: int) -> bool:
        """Whether the layer runs an MLP: an "mlp" layer always, the others after their
        mixer unless the MLPs are layers of their own."""
        return self.layer_types[layer] == "mlp" or self.mlp_after_mixer

    @property
    def num_attention_layers(self) -> int:
        return sum(map(self.is_attention, range(self.num_layers)))

    @property
    def num_recurrent_layers(self) -> int:
        return sum(map(self.is_recurrent, range(self.num_layers)))

    def state_bytes_per_seq(self) -> int:
        """fp32 bytes one sequence's recurrent state takes, summed over the recurrent layers."""
        if self.recurrent is None:
            return 0
        return 4 * self.num_recurrent_layers * self.recurrent.state_elements

    def kv_bytes_per_token(self, bytes_per_element: float, sliding: bool | None = None) -> float:
        """Key + value bytes one token adds to the cache, summed over the attention layers:
        all of them, or only the sliding-window (sliding=True) or full-attention (False)
        ones. Recurrent layers, MLP-only layers and layers that read another's KV keep
        none."""
        if self.mla is not None:  # the latent and its rotary key part; V is read from it
            return 0.0 if sliding else self.num_layers * self.mla.latent_width * bytes_per_element
        kept = [i for i in range(self.num_layers) if self.owns_kv(i)
                and (sliding is None or self.is_sliding(i) == sliding)]
        per_token = sum(self.layer_kv_heads(i) * self.layer_head_dim(i) for i in kept)
        return 2 * per_token * bytes_per_element


# families that interleave sliding-window and global layers: every n-th layer is global
GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}


def interleaved_layer_types(num_layers: int, global_every: int | None) -> tuple[str, ...]:
    """Which layers slide, the one rule kvlab uses for a family that interleaves them: layer i
    attends globally when (i + 1) % global_every == 0 and slides otherwise (Gemma 2: every
    2nd global, Gemma 3: every 6th); global_every None: every layer slides (Mistral)."""
    if global_every is None:
        return ("sliding",) * num_layers
    return tuple("full" if (i + 1) % global_every == 0 else "sliding"
                 for i in range(num_layers))


HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full",
                  "conv": "recurrent", "linear_attention": "recurrent",
                  # Granite 4 hybrid's and Nemotron-H's own names ("moe": experts alone)
                  "mamba": "recurrent", "attention": "full", "mlp": "mlp", "moe": "mlp"}
# Nemotron-H's hybrid_override_pattern, a character per layer: Mamba-2, attention, MLP, experts
PATTERN_LAYER_TYPES = {"M": "recurrent", "*": "full", "-": "mlp", "E": "mlp"}


def hf_layer_types(types: list[str] | str) -> tuple[str, ...]:
    """An HF config's `layer_types` ("sliding_attention", "full_attention"; a hybrid's "conv"
    (LFM2), "linear_attention" (Qwen3.5), "mamba", "mlp", "moe") as kvlab's "sliding",
    "full", "recurrent", "mlp"; a string is a pattern of PATTERN_LAYER_TYPES characters."""
    if isinstance(types, str):
        return tuple(PATTERN_LAYER_TYPES.get(t, "full") for t in types)
    return tuple(HF_LAYER_TYPES.get(t, "full") for t in types)

