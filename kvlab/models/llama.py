"""Llama (2, 3.x): RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP.

Also the base the Qwen files build on: Qwen2 adds a QKV bias, Qwen3 adds QK-norm, both
switched on by the config, so this file holds the forward pass they share.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.kernels.packed import PackedWeight
from kvlab.models import decode_c, decode_gpu
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.layers import (
    LongRopeTable,
    RopeTable,
    ScaledRope,
    Weight,
    add_rms_norm,
    as_dtype,
    embed,
    linear,
    norm_rope,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    split,
    swiglu,
)
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, gguf_rope, hf_rope

# checkpoint name -> kvlab name; "{i}" is the layer index
GGUF_NAMES = NameTable(
    globals={"token_embd.weight": "embed", "output_norm.weight": "norm",
             "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs"},
    layer_prefix="blk.{i}.",
    layer={"attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
           "attn_v.weight": "v", "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm",
           "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
           "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
           "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"},
)
HF_NAMES = NameTable(
    globals={"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
             "lm_head.weight": "lm_head"},
    layer_prefix="model.layers.{i}.",
    layer={"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
           "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
           "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
           "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
           "mlp.down_proj.weight": "down", "self_attn.q_proj.bias": "q_bias",
           "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
           "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"},
)


def config_from_gguf(meta: dict[str, Any], arch: str = "llama") -> ModelConfig:
    g = gguf_get(meta, arch)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = g("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        num_layers=int(g("block_count")), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=gguf_rope(g),
        tie_word_embeddings=True,  # refined by the loader: untied when output.weight exists
        qk_norm=arch == "qwen3",
        name=str(meta.get("general.name", arch)))


def config_from_hf(cfg: dict[str, Any], arch: str = "llama") -> ModelConfig:
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=hf_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3", name=cfg.get("_name_or_path", arch))


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row interleaving llama.cpp's converter applies to Llama's q/k weights.

    GGUF stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...) for ggml's
    interleaved rope; kvlab rotates halves as HF does, so rows go back to halves.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _rotary(config: ModelConfig, weights: dict[str, Weight]
            ) -> torch.Tensor | LongRopeTable | ScaledRope:
    """The inverse frequencies RoPE rotates by (with YaRN's cos/sin scale), or longrope's
    two sets."""
    if config.rope.longrope is not None:
        return LongRopeTable.build(config.rope, config.head_dim, weights)
    inv = rope_inv_freq(config.rope, config.head_dim)
    if "rope_freqs" in weights:  # llama3 scaling baked into a GGUF tensor
        inv = inv / weights["rope_freqs"].float()
    return ScaledRope.build(config.rope, inv)


class LlamaModel:
    """Weights (frozen after load) plus the forward pass; run state comes in as arguments.

    Under tensor parallel (tp.size > 1) the config and layers are this rank's shard and the
    outputs of o and down are summed over the ranks; the one-call C layers are not used then
    (they run every layer in one call, with no place for the all-reduces)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        self.config, self.weights, self.layers, self.tp = config, weights, layers, tp
        # the rotations, their cos/sin kept by position (RopeTable)
        limit, device = config.max_position_embeddings, weights["norm"].device
        self.inv_freq = RopeTable(_rotary(config, weights).to(device), limit)
        local = config.local_rope  # sliding layers' own RoPE (OLMo 3: no YaRN there)
        self.inv_freq_local = (None if local is None else RopeTable(ScaledRope.build(
            local, rope_inv_freq(local, config.head_dim)).to(device), limit))
        # on GPUs, RoPE runs in the dense products' dtype (as transformers does): q and k
        # then reach the cache and attention without a cast kernel per layer
        first = layers[0]["qkv"].parts[0] if layers else None
        self.rope_dtype = (first.dtype if isinstance(first, torch.Tensor | PackedWeight)
                           and first.is_cuda else torch.float32)
        self.c_plan = (decode_c.build_plan(config, layers, "silu")  # decode layers in one C call
                       if tp.size == 1 else None)
        # on CUDA with triton: decode layers as products and fused Triton kernels
        self.gpu_plan = decode_gpu.build_plan(config, layers, "silu") if tp.size == 1 else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVStore], meta: AttentionMetadata,
                trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        """ids, positions: [T] -> final hidden states [T, hidden] (before the final norm).

        `trace`: a list the MoE layers append their chosen expert ids [T, k] to, one entry per
        MoE layer (for a caller that asks; dense layers add nothing)."""
        c = self.config
        x = embed(ids, self.weights["embed"])
        cos, sin = (as_dtype(t, self.rope_dtype) for t in rope_cos_sin(positions, self.inv_freq))
        ropes = {False: (cos, sin), True: self._second_rope(positions, cos, sin)}
        q_scale = _query_temperature(c, positions)
        if self.c_plan is not None and trace is None and q_scale is None and decode_c.run(
                self.c_plan, c, x, ropes, kv_caches, meta):  # C: no expert trace
            return x
        if self.gpu_plan is not None and trace is None and q_scale is None and decode_gpu.run(
                self.gpu_plan, c, x, ropes, kv_caches, meta, self.layers):
            return x
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):  # x: embed's own
            # OLMo 2: no norm before attention or MLP, a norm of each output instead
            h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps) if "attn_norm" in layer else x
            h = self.attention(h, layer, *ropes[c.second_rope(i)], cache, meta,
                               c.is_sliding(i), q_scale)
            x = self._residual(x, h, layer.get("post_attn_norm"))
            h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps) if "mlp_norm" in layer else x
            x = self._residual(x, self.mlp(h, layer, trace), layer.get("post_mlp_norm"))
        return x

    def _second_rope(self, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the layers config.second_rope picks (the C plan's second table): the
        identity rotation (cos 1, sin 0: exact) of layers without RoPE, or sliding layers'
        own RoPE, or the same as every layer's."""
        if self.config.no_rope_layers:
            return torch.ones_like(cos), torch.zeros_like(sin)
        if self.inv_freq_local is None:
            return cos, sin
        return tuple(as_dtype(t, self.rope_dtype)
                     for t in rope_cos_sin(positions, self.inv_freq_local))

    def _residual(self, x: torch.Tensor, h: torch.Tensor,
                  post_norm: torch.Tensor | None) -> torch.Tensor:
        """x + h, or x + rms_norm(h) where the layer norms its outputs; x updated in place."""
        if post_norm is None:
            x += h
            return x
        return add_rms_norm(x, h, post_norm, self.config.rms_norm_eps)

    def mlp(self, h: torch.Tensor, layer: dict[str, Weight],
            trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: SwiGLU (the mixture-of-experts files override this)."""
        gate_up = linear(h, layer["gate_up"], transient=True)  # swiglu consumes it here
        return self.tp.all_reduce(linear(swiglu(gate_up), layer["down"]))

    def attention(self, h: torch.Tensor, layer: dict[str, Weight], cos: torch.Tensor,
                  sin: torch.Tensor, cache: KVStore, meta: AttentionMetadata,
                  sliding: bool, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        q, k, v = self._heads(linear(h, layer["qkv"], layer.get("qkv_bias")), layer)
        # qk_norm: per head, where the layer has the weights (GLM-4.5's are optional)
        q_norm, k_norm = (layer.get("q_norm"), layer.get("k_norm")) if c.qk_norm else (None, None)
        q = norm_rope(q, q_norm, cos, sin, c.rms_norm_eps)
        k = norm_rope(k, k_norm, cos, sin, c.rms_norm_eps)
        if q_scale is not None:
            q = q * q_scale.to(q.dtype)
        out = paged_attention(q, k, v, cache, meta, sliding=sliding, scale=c.scale,
                              sinks=layer.get("sinks"))  # gpt-oss: a sink logit per head
        out = self.tp.all_reduce(linear(out, layer["o"]))
        return out if "o_bias" not in layer else out + layer["o_bias"]  # once, after the sum

    def _heads(self, qkv: torch.Tensor, layer: dict[str, Weight]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The qkv product [T, (H + 2 KVH) * D] as q [T, H, D], k and v [T, KVH, D]: views,
        by heads first and then split."""
        c = self.config
        if c.qk_norm_whole:  # OLMoE: one norm over all heads, before the split into heads
            q, k, v = split(qkv, layer["qkv"])
            q, k = self._whole_norm(q, layer["q_norm"]), self._whole_norm(k, layer["k_norm"])
            return (q.reshape(-1, c.num_heads, c.head_dim),
                    k.reshape(-1, c.num_kv_heads, c.head_dim),
                    v.reshape(-1, c.num_kv_heads, c.head_dim))
        heads = qkv.reshape(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        return heads.split_with_sizes((c.num_heads, c.num_kv_heads, c.num_kv_heads), dim=1)

    def _whole_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over all heads as one vector; under tensor parallel, over all ranks' heads."""
        if self.tp.size == 1:
            return rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)
        return self.tp.rms_norm(x, weight, self.config.rms_norm_eps,
                                x.shape[-1] * self.tp.size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32, for the positions whose next token is needed."""
        h = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        head = self.weights.get("lm_head", self.weights["embed"])
        return as_dtype(linear(h, head), torch.float32)


def _query_temperature(config: ModelConfig, positions: torch.Tensor) -> torch.Tensor | None:
    """[T, 1, 1] query scales 1 + beta * ln(1 + floor(position / original)) (Mistral 3), or
    None where the config has none or (on the CPU, where the check costs no device sync)
    every position is below `original`, so all scales are 1."""
    if config.query_temperature is None:
        return None
    beta, original = config.query_temperature
    if not positions.is_cuda and int(positions.max()) < original:
        return None
    return (1 + beta * torch.log1p(torch.floor(positions.float() / original)))[:, None, None]


def _gguf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "q":
        return unpermute_qk(t, config.num_heads)
    if name == "k":
        return unpermute_qk(t, config.num_kv_heads)
    return t


SPEC = ArchSpec(
    name="llama", model_cls=LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_gguf_transform, hf_architectures=("LlamaForCausalLM",))
