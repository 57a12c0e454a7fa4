"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): the Llama decoder with q/k/v bias, optional
per-head QK-norm and partial rotary (the first half of each head's dimensions rotate, by
halves), its first `first_k_dense_replace` layers dense and the rest a mixture of experts:
a sigmoid router whose choice adds a per-expert correction bias (noaux_tc, grouped top-k),
weights renormalised and scaled by routed_scaling_factor, plus an ungated shared expert.

Partial rotary runs as a full-width rotation: q/k rows are rearranged at load
(layers.permute_partial_rotary) and the unrotated pairs get zero frequencies.

The checkpoints end in multi-token-prediction (nextn) layers after num_hidden_layers
(llama.cpp's block_count counts them, nextn_predict_layers says how many); the main model
leaves them out, and --speculative mtp runs the first as its proposer (kvlab.models.mtp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.config import ModelConfig, MoeConfig
from kvlab.errors import ModelLoadError
from kvlab.models import llama, moe
from kvlab.models.layers import permute_partial_rotary
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER,
           "post_attention_norm.weight": "mlp_norm",  # GLM's name for the pre-MLP norm
           "exp_probs_b.bias": "router_bias"})
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer, **moe.HF_LAYER,
           "mlp.gate.e_score_correction_bias": "router_bias",
           **moe.hf_shared_expert("mlp.shared_experts")},
    experts=moe.HF_EXPERTS)
_ROTATED = {"q", "k", "q_bias", "k_bias", "q_norm", "k_norm"}


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "glm4moe")
    config = llama.config_from_gguf(meta, arch="glm4moe")
    base = moe.moe_from_gguf(meta, "glm4moe", norm_topk_prob=True)
    if int(g("expert_gating_func", 2)) != 2:
        raise ModelLoadError("glm4moe.expert_gating_func must be 2 (sigmoid)")
    routing = dataclasses.replace(
        base, shared_intermediate_size=int(g("expert_shared_count", 0))
        * base.expert_intermediate_size, scoring="sigmoid",
        groups=int(g("expert_group_count", 1)), top_groups=int(g("expert_group_used_count", 1)),
        routed_scale=float(g("expert_weights_scale", 1.0)))
    rotary = int(g("rope.dimension_count", config.head_dim))
    return dataclasses.replace(
        config, num_layers=config.num_layers - int(g("nextn_predict_layers", 0)),
        qk_norm=True, moe=routing,
        rope=dataclasses.replace(config.rope, partial=rotary / config.head_dim))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_hf(cfg, arch="glm4moe")
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    return dataclasses.replace(config, qk_norm=bool(cfg.get("use_qk_norm", False)),
                               moe=hf_sigmoid_moe(cfg), rope=dataclasses.replace(config.rope,
                                                                          partial=partial))


def hf_sigmoid_moe(cfg: dict[str, Any]) -> MoeConfig:
    """The sigmoid-routed experts of an HF config (GLM-4.5's and DeepSeek-V3's keys)."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    groups = int(cfg.get("n_group") or 1)
    if not experts or experts % groups:
        raise ModelLoadError(f"GLM-4.5 needs n_routed_experts divisible by n_group, got "
                             f"{experts} and {groups}")
    inter = int(cfg["moe_intermediate_size"])
    return MoeConfig(
        num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=inter, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
        scoring="sigmoid", groups=groups, top_groups=int(cfg.get("topk_group") or 1),
        routed_scale=float(cfg.get("routed_scaling_factor", 1.0)))


def _transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Both loaders: each head's rows laid out for a full-width rotation."""
    if name not in _ROTATED or config.rope.partial == 1.0:
        return t
    return permute_partial_rotary(t, config.head_dim, int(config.head_dim * config.rope.partial))


SPEC = ArchSpec(
    name="glm4moe", model_cls=moe.MoeModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_transform, hf_transform=_transform,  # dense first layers: no router
    hf_architectures=("Glm4MoeForCausalLM",))
