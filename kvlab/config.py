"""ModelConfig: the shape of a transformer, built once from checkpoint metadata and frozen.

Stdlib only. Each architecture file in kvlab/models turns GGUF metadata or an HF
config.json into one of these; everything downstream reads it and never mutates it.
"""

from __future__ import annotations

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
class RopeConfig:
    theta: float = 10000.0
    # llama3 frequency scaling (Llama 3.1/3.2): None or a tuple
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    llama3: tuple[float, float, float, int] | None = None
    linear_factor: float = 1.0  # positions divided by this ("linear" rope scaling)
    longrope: LongRope | None = None


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token runs `experts_per_token` of `num_experts`."""

    num_experts: int
    experts_per_token: int  # top-k of the router's softmax
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the k chosen probabilities to sum to 1
    shared_intermediate_size: int = 0  # an expert every token runs (Qwen2-MoE); 0: none


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
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"
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

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding" and self.sliding_window is not None

    @property
    def num_sliding_layers(self) -> int:
        return sum(map(self.is_sliding, range(self.num_layers)))

    def kv_bytes_per_token(self, bytes_per_element: float, sliding: bool | None = None) -> float:
        """Key + value bytes one token adds to the cache, summed over layers: all of them, or
        only the sliding-window (sliding=True) or full-attention (False) ones."""
        layers = (self.num_layers if sliding is None else
                  self.num_sliding_layers if sliding else
                  self.num_layers - self.num_sliding_layers)
        return 2 * layers * self.num_kv_heads * self.head_dim * bytes_per_element


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


def hf_layer_types(types: list[str]) -> tuple[str, ...]:
    """An HF config's `layer_types` ("sliding_attention" / "full_attention") as kvlab's."""
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types)

