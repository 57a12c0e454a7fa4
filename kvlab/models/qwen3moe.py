"""Qwen3-MoE: Qwen3's attention (QK-norm per head, no q/k permutation in GGUF) with a mixture
of experts in place of the MLP: softmax over all experts, top-k, renormalised over the k when
`norm_topk_prob` (llama.cpp always renormalises this family)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig
from kvlab.models import llama, moe
from kvlab.models.spec import ArchSpec, NameTable

GGUF_NAMES = NameTable(globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
                       layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER})
HF_NAMES = NameTable(globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
                     layer={**llama.HF_NAMES.layer, **moe.HF_LAYER}, experts=moe.HF_EXPERTS)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="qwen3moe")
    return dataclasses.replace(config, qk_norm=True,
                               moe=moe.moe_from_gguf(meta, "qwen3moe", norm_topk_prob=True))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_hf(cfg, arch="qwen3moe")
    return dataclasses.replace(config, qk_norm=True, moe=moe.moe_from_hf(cfg))


SPEC = ArchSpec(
    name="qwen3moe", model_cls=moe.MoeModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("Qwen3MoeForCausalLM",))
