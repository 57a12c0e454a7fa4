"""Gemma 3 (text): sliding-window local layers between global ones, QK-norm, pre and
post norms around attention and MLP, GeGLU, embeddings scaled by sqrt(hidden), tied output.

Norm weights are held as the full multiplier: GGUF stores 1 + w already, HF stores w and
gets 1 added at load. Gemma 2 (gemma2.py) runs this forward pass too: no QK-norm weights,
soft-capped attention scores.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.config import (
    GLOBAL_EVERY,
    ModelConfig,
    RopeConfig,
    hf_layer_types,
    interleaved_layer_types,
)
from kvlab.models import decode_c, decode_gpu
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.layers import (
    RopeTable,
    Weight,
    add_rms_norm,
    embed,
    geglu,
    linear,
    norm_rope,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    split,
)
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

GGUF_NAMES = NameTable(
    globals={"token_embd.weight": "embed", "output_norm.weight": "norm"},
    layer_prefix="blk.{i}.",
    layer={"attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
           "attn_v.weight": "v", "attn_output.weight": "o",
           "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
           "post_attention_norm.weight": "post_attn_norm", "ffn_norm.weight": "mlp_norm",
           "post_ffw_norm.weight": "post_mlp_norm", "ffn_gate.weight": "gate",
           "ffn_up.weight": "up", "ffn_down.weight": "down"},
)
HF_NAMES = NameTable(
    globals={"model.embed_tokens.weight": "embed", "model.norm.weight": "norm"},
    layer_prefix="model.layers.{i}.",
    layer={"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
           "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
           "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "q_norm",
           "self_attn.k_norm.weight": "k_norm",
           "post_attention_layernorm.weight": "post_attn_norm",
           "pre_feedforward_layernorm.weight": "mlp_norm",
           "post_feedforward_layernorm.weight": "post_mlp_norm",
           "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
           "mlp.down_proj.weight": "down"},
)
NORMS = {"norm", "attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"}
LOCAL_ROPE_THETA = 10000.0  # GGUF does not store it; Gemma 3 uses 10k on local layers


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "gemma3")
    heads, layers = int(g("attention.head_count")), int(g("block_count"))
    head_dim = int(g("attention.key_length"))
    scaling = (RopeConfig(theta=float(g("rope.freq_base", 1e6)),
                          linear_factor=float(g("rope.scaling.factor", 1.0))))
    return ModelConfig(
        architecture="gemma3", vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=int(g("embedding_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv")), head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope=scaling,
        local_rope=RopeConfig(theta=LOCAL_ROPE_THETA),
        sliding_window=int(g("attention.sliding_window")),
        layer_types=interleaved_layer_types(layers, GLOBAL_EVERY["gemma3"]),
        tie_word_embeddings=True, qk_norm=True, attn_scale=head_dim ** -0.5,
        final_logit_softcapping=g("final_logit_softcapping", None),
        name=str(meta.get("general.name", "gemma3")))


def _hf_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention", {"rope_theta": cfg.get("rope_theta", 1e6)})
    local = params.get("sliding_attention",
                       {"rope_theta": cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA)})
    factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
    return (RopeConfig(theta=float(full["rope_theta"]), linear_factor=factor),
            RopeConfig(theta=float(local["rope_theta"])))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    every = cfg.get("sliding_window_pattern", GLOBAL_EVERY["gemma3"])
    layer_types = hf_layer_types(types) if types else interleaved_layer_types(layers, every)
    rope, local = _hf_ropes(cfg)
    return ModelConfig(
        architecture="gemma3", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=layers, num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=rope, local_rope=local,
        sliding_window=cfg.get("sliding_window"), layer_types=layer_types,
        tie_word_embeddings=True, qk_norm=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", cfg["head_dim"])) ** -0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        name=cfg.get("_name_or_path", "gemma3"))


class Gemma3Model:
    """Weights (frozen after load) plus the forward pass; run state comes in as arguments.

    Under tensor parallel the outputs of o and down are summed over the ranks (before the
    post norms) and the one-call C layers are not used, as in LlamaModel."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        self.config, self.weights, self.layers, self.tp = config, weights, layers, tp
        device = weights["norm"].device
        limit = config.max_position_embeddings  # cos/sin kept by position (RopeTable)
        self.inv_freq_global = RopeTable(rope_inv_freq(config.rope, config.head_dim).to(device),
                                         limit)
        self.inv_freq_local = RopeTable(rope_inv_freq(config.local_rope or config.rope,
                                                      config.head_dim).to(device), limit)
        self.embed_scale = config.hidden_size ** 0.5
        # decode layers in one C call (Gemma 2's soft-cap included)
        self.c_plan = None if tp.size > 1 else decode_c.build_plan(config, layers, "gelu_tanh")
        self.gpu_plan = (None if tp.size > 1  # on CUDA with triton: fused Triton kernels
                         else decode_gpu.build_plan(config, layers, "gelu_tanh"))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVStore],
                meta: AttentionMetadata) -> torch.Tensor:
        """ids, positions: [T] -> final hidden states [T, hidden] (before the final norm)."""
        c = self.config
        x = embed(ids, self.weights["embed"]) * self.embed_scale
        ropes = {False: rope_cos_sin(positions, self.inv_freq_global),
                 True: rope_cos_sin(positions, self.inv_freq_local)}
        if self.c_plan is not None and decode_c.run(self.c_plan, c, x, ropes, kv_caches, meta):
            return x
        if self.gpu_plan is not None and decode_gpu.run(self.gpu_plan, c, x, ropes, kv_caches,
                                                        meta, self.layers):
            return x
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            sliding = c.is_sliding(i)
            h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps)
            h = self.attention(h, layer, ropes[sliding], cache, meta, sliding)
            x = add_rms_norm(x, h, layer["post_attn_norm"], c.rms_norm_eps)
            h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps)
            h = geglu(linear(h, layer["gate_up"]))  # gate | up: equal halves
            h = self.tp.all_reduce(linear(h, layer["down"]))
            x = add_rms_norm(x, h, layer["post_mlp_norm"], c.rms_norm_eps)
        return x

    def attention(self, h: torch.Tensor, layer: dict[str, Weight],
                  rope: tuple[torch.Tensor, torch.Tensor],
                  cache: KVStore, meta: AttentionMetadata,
                  sliding: bool) -> torch.Tensor:
        c = self.config
        q, k, v = split(linear(h, layer["qkv"]), layer["qkv"])
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        q = norm_rope(q, layer.get("q_norm"), *rope, c.rms_norm_eps)  # Gemma 2: no QK-norm
        k = norm_rope(k, layer.get("k_norm"), *rope, c.rms_norm_eps)
        out = paged_attention(q, k, v, cache, meta, sliding=sliding, scale=c.scale,
                              softcap=c.attn_logit_softcapping)
        return self.tp.all_reduce(linear(out, layer["o"]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 through the tied embedding matrix."""
        h = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        out = linear(h, self.weights["embed"]).float()
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap


def _hf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    return t.float() + 1.0 if name in NORMS else t


SPEC = ArchSpec(
    name="gemma3", model_cls=Gemma3Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_transform=_hf_transform, hf_architectures=("Gemma3ForCausalLM", "Gemma3TextModel"))
