"""Phi-3: the Llama decoder with q|k|v and gate|up each stored as one matrix (kept fused: one
product each), RoPE on whole heads (NeoX halves, no q/k permutation in GGUF).

Phi-3's long-context variants (128k, Phi-3.5) scale RoPE with per-frequency "longrope"
factors (kvlab.models.layers.LongRopeTable); Phi-4-mini rotates part of each head, which is
refused with the reason until it is implemented.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import LongRope, ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models import llama
from kvlab.models.spec import ArchSpec, NameTable

GGUF_NAMES = NameTable(
    globals={**llama.GGUF_NAMES.globals, "rope_factors_short.weight": "rope_short",
             "rope_factors_long.weight": "rope_long"},
    layer_prefix="blk.{i}.",
    layer={"attn_norm.weight": "attn_norm", "attn_qkv.weight": "qkv",
           "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm", "ffn_up.weight": "gate_up",
           "ffn_down.weight": "down"},
)
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={"input_layernorm.weight": "attn_norm", "self_attn.qkv_proj.weight": "qkv",
           "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
           "mlp.gate_up_proj.weight": "gate_up", "mlp.down_proj.weight": "down"},
)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="phi3")
    rotary = int(meta.get("phi3.rope.dimension_count", config.head_dim))
    _check_rotary(rotary / config.head_dim)
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is None:
        return config
    # the factors are tensors (rope_factors_short/long), read with the weights
    longrope = LongRope(int(original), float(meta.get("phi3.rope.scaling.attn_factor", 1.0)))
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, longrope=longrope))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    _check_rotary(float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                                     1.0))))
    return llama.config_from_hf(cfg, arch="phi3")


def _check_rotary(share: float) -> None:
    if share != 1.0:
        raise ModelLoadError(f"partial rotary embeddings ({share:g} of each head) are not "
                             "supported yet (valid: 1.0)")


def fused_sizes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    kv = c.num_kv_heads * c.head_dim
    return {"qkv": (c.num_heads * c.head_dim, kv, kv),
            "gate_up": (c.intermediate_size, c.intermediate_size)}


SPEC = ArchSpec(
    name="phi3", model_cls=llama.LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("Phi3ForCausalLM",), fused_sizes=fused_sizes)
