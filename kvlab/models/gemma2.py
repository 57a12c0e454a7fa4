"""Gemma 2: Gemma 3's decoder without QK-norm, with soft-capped attention scores and logits,
sliding-window attention on every other layer (the first slides) and one RoPE for all.

The forward pass is Gemma3Model's (this file only reads the configs): what differs is data,
a cap on the scores and no q/k norm weights.
"""

from __future__ import annotations

from typing import Any

from kvlab.config import (
    GLOBAL_EVERY,
    ModelConfig,
    RopeConfig,
    hf_layer_types,
    interleaved_layer_types,
)
from kvlab.models import gemma3
from kvlab.models.spec import ArchSpec, gguf_get, hf_rope


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "gemma2")
    heads, layers = int(g("attention.head_count")), int(g("block_count"))
    hidden, head_dim = int(g("embedding_length")), int(g("attention.key_length"))
    # GGUF keeps no query_pre_attn_scalar: like llama.cpp, hidden / heads for the 46-layer
    # 27B model, head_dim for the others
    scalar = hidden // heads if layers == 46 else head_dim
    return ModelConfig(
        architecture="gemma2", vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv")), head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeConfig(theta=float(g("rope.freq_base", 10000.0))),
        sliding_window=int(g("attention.sliding_window")),
        layer_types=interleaved_layer_types(layers, GLOBAL_EVERY["gemma2"]),
        tie_word_embeddings=True, attn_scale=scalar ** -0.5,
        attn_logit_softcapping=g("attn_logit_softcapping", None),
        final_logit_softcapping=g("final_logit_softcapping", None),
        name=str(meta.get("general.name", "gemma2")))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    layer_types = (hf_layer_types(types) if types else
                   interleaved_layer_types(layers, GLOBAL_EVERY["gemma2"]))
    return ModelConfig(
        architecture="gemma2", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=layers, num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=hf_rope(cfg), sliding_window=cfg.get("sliding_window"), layer_types=layer_types,
        tie_word_embeddings=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", cfg["head_dim"])) ** -0.5,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        name=cfg.get("_name_or_path", "gemma2"))


SPEC = ArchSpec(
    name="gemma2", model_cls=gemma3.Gemma3Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=gemma3.GGUF_NAMES, hf_names=gemma3.HF_NAMES,
    hf_transform=gemma3.SPEC.hf_transform, hf_architectures=("Gemma2ForCausalLM",))
