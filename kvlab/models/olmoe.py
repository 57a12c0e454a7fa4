"""OLMoE: the Llama decoder with RMSNorm over the whole q and k projections (all heads as one
vector, not per head) and a mixture of experts (softmax, top-k, renormalised only when
`norm_topk_prob`; llama.cpp never). GGUF keeps HF's rotary halves: no q/k permutation."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models import llama, moe
from kvlab.models.spec import ArchSpec, NameTable

GGUF_NAMES = NameTable(globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
                       layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER})
HF_NAMES = NameTable(globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
                     layer={**llama.HF_NAMES.layer, **moe.HF_LAYER}, experts=moe.HF_EXPERTS)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="olmoe")
    return dataclasses.replace(config, qk_norm_whole=True,
                               moe=moe.moe_from_gguf(meta, "olmoe", norm_topk_prob=False))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError(f"OLMoE with clip_qkv={cfg['clip_qkv']} is not supported yet "
                             "(valid: null)")
    config = llama.config_from_hf(cfg, arch="olmoe")
    return dataclasses.replace(config, qk_norm_whole=True,
                               moe=moe.moe_from_hf(cfg, inter_key="intermediate_size"))


SPEC = ArchSpec(
    name="olmoe", model_cls=moe.MoeModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("OlmoeForCausalLM",))
