"""OLMo 2: the Llama decoder with its norms moved after the products: no norm before
attention or the MLP, an RMSNorm of each one's output before the residual add, and QK-norm
over all heads' queries (keys) as one vector, as OLMoE has.

llama.cpp rotates these models' q/k by halves (NeoX), so its GGUF rows need no unpermuting.
The one-call C decode plan needs a norm before attention, so decode runs the per-op path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig
from kvlab.models import llama
from kvlab.models.spec import ArchSpec, NameTable

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
    return dataclasses.replace(llama.config_from_gguf(meta, arch="olmo2"), qk_norm_whole=True)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return dataclasses.replace(llama.config_from_hf(cfg, arch="olmo2"), qk_norm_whole=True)


SPEC = ArchSpec(
    name="olmo2", model_cls=llama.LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("Olmo2ForCausalLM",))
