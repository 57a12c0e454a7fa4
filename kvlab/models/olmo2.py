"""OLMo 2: the Llama decoder with its norms moved after the products: no norm before
attention or the MLP, an RMSNorm of each one's output before the residual add, and QK-norm
over all heads' queries (keys) as one vector, as OLMoE has.

OLMo 3 is OLMo 2 with sliding-window layers (three of every four by default) whose RoPE is
plain (theta only) while the full-attention layers may scale theirs (YaRN); llama.cpp writes
it as `olmo2` with the window, its per-layer pattern and (optionally) rope.freq_base_swa.

llama.cpp rotates these models' q/k by halves (NeoX), so its GGUF rows need no unpermuting.
The one-call C decode plan runs these layers with no norm before attention and MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig, RopeConfig, hf_layer_types, interleaved_layer_types
from kvlab.models import llama
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, hf_rope

OLMO3_GLOBAL_EVERY = 4  # llama.cpp's default pattern when the file has none

_GGUF_LAYER = {k: v for k, v in llama.GGUF_NAMES.layer.items()
               if v not in ("attn_norm", "mlp_norm")}
GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**_GGUF_LAYER, "post_attention_norm.weight": "post_attn_norm",
           "post_ffw_norm.weight": "post_mlp_norm"})
_HF_LAYER = {k: v for k, v in llama.HF_NAMES.layer.items()
             if v not in ("attn_norm", "mlp_norm")}
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**_HF_LAYER, "post_attention_layernorm.weight": "post_attn_norm",
           "post_feedforward_layernorm.weight": "post_mlp_norm"})


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = dataclasses.replace(llama.config_from_gguf(meta, arch="olmo2"), qk_norm_whole=True)
    g = gguf_get(meta, "olmo2")
    window = int(g("attention.sliding_window", 0))
    if not window:
        return config
    pattern = g("attention.sliding_window_pattern", None)
    types = (tuple("sliding" if p else "full" for p in pattern) if pattern is not None else
             interleaved_layer_types(config.num_layers, OLMO3_GLOBAL_EVERY))
    local = RopeConfig(theta=float(g("rope.freq_base_swa", config.rope.theta)))
    return dataclasses.replace(config, sliding_window=window, layer_types=types,
                               local_rope=local if local != config.rope else None)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = dataclasses.replace(llama.config_from_hf(cfg, arch="olmo2"), qk_norm_whole=True)
    if not cfg.get("sliding_window"):
        return config
    # OLMo 3: a RoPE per kind of layer (a config of transformers 4: rope_theta and
    # rope_scaling for the full-attention layers, plain rope_theta for the sliding ones)
    params = cfg.get("rope_parameters") or {}
    context = {"max_position_embeddings": config.max_position_embeddings}
    rope, local = ((hf_rope({**context, "rope_parameters": params[kind]})
                    for kind in ("full_attention", "sliding_attention"))
                   if "full_attention" in params else
                   (config.rope, RopeConfig(theta=config.rope.theta)))
    types = cfg.get("layer_types")
    return dataclasses.replace(
        config, rope=rope, local_rope=local if local != rope else None,
        sliding_window=int(cfg["sliding_window"]),
        layer_types=(hf_layer_types(types) if types else
                     interleaved_layer_types(config.num_layers, OLMO3_GLOBAL_EVERY)))


SPEC = ArchSpec(
    name="olmo2", model_cls=llama.LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"))
