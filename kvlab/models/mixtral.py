"""Mixtral: the Llama decoder (q/k rows interleaved in GGUF) with a mixture of experts,
top-k of the softmax always renormalised over the k. llama.cpp writes it as GGUF
architecture `llama` with `llama.expert_count` > 0; the registry sends those files here."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models import llama, moe
from kvlab.models.spec import ArchSpec, NameTable

GGUF_NAMES = NameTable(globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
                       layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER})
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer, "block_sparse_moe.gate.weight": "router", **moe.HF_LAYER},
    experts={"block_sparse_moe.experts.{e}.w1.weight": "gate_exps",
             "block_sparse_moe.experts.{e}.w3.weight": "up_exps",
             "block_sparse_moe.experts.{e}.w2.weight": "down_exps"})


def is_moe_gguf(meta: dict[str, Any]) -> bool:
    """A GGUF `llama` file whose layers hold experts."""
    return int(meta.get("llama.expert_count", 0) or 0) > 0


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="llama")
    return dataclasses.replace(config, architecture="mixtral",
                               moe=moe.moe_from_gguf(meta, "llama", norm_topk_prob=True))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("sliding_window"):
        raise ModelLoadError(f"Mixtral with sliding_window={cfg['sliding_window']} is not "
                             "supported yet (valid: null)")
    config = llama.config_from_hf(cfg, arch="mixtral")
    return dataclasses.replace(config, moe=moe.moe_from_hf(
        cfg, inter_key="intermediate_size",
        norm_topk_prob=True))


SPEC = ArchSpec(
    name="mixtral", model_cls=moe.MoeModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=llama.SPEC.gguf_transform, hf_architectures=("MixtralForCausalLM",),
    gguf_variant_of=("llama", is_moe_gguf))
