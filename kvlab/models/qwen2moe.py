"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with a mixture of
experts plus a shared expert every token runs, scaled by sigmoid(shared_expert_gate . h).
Routing is not renormalised over the top k unless the config says so (llama.cpp never)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.models import llama, moe
from kvlab.models.spec import ArchSpec, NameTable

GGUF_NAMES = NameTable(globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
                       layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER})
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer, **moe.HF_LAYER,
           "mlp.shared_expert_gate.weight": "shexp_router",
           "mlp.shared_expert.gate_proj.weight": "shexp_gate",
           "mlp.shared_expert.up_proj.weight": "shexp_up",
           "mlp.shared_expert.down_proj.weight": "shexp_down"},
    experts=moe.HF_EXPERTS)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="qwen2moe")
    return dataclasses.replace(config,
                               moe=moe.moe_from_gguf(meta, "qwen2moe", norm_topk_prob=False))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return dataclasses.replace(llama.config_from_hf(cfg, arch="qwen2moe"),
                               moe=moe.moe_from_hf(cfg))


def _gguf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    # llama.cpp may store the shared expert's gate as a vector [hidden]: one output row
    return t.reshape(1, -1) if name == "shexp_router" else t


SPEC = ArchSpec(
    name="qwen2moe", model_cls=moe.MoeModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_gguf_transform, hf_architectures=("Qwen2MoeForCausalLM",))
