"""Mistral 3 / Ministral 3 text decoder: the Llama decoder with YaRN rope scaling and Llama 4's
query temperature, queries scaled by 1 + beta * ln(1 + floor(position / original)) from the
original context length on (`llama_4_scaling_beta`; llama.cpp's attention.temperature_scale).

Two HF forms: Ministral3ForCausalLM (text only, Llama's names) and the multimodal
Mistral3ForConditionalGeneration, whose text decoder sits under `language_model.` beside a
Pixtral vision tower and projector; kvlab loads that decoder alone and says so. llama.cpp
writes the text decoder as GGUF architecture `mistral3` (q/k rows interleaved, as Llama's).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvlab.config import ModelConfig
from kvlab.models import llama, mistral
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, multimodal_text_config

log = logging.getLogger("kvlab.models")

# the multimodal checkpoint's text decoder, as save_pretrained writes it
MULTIMODAL_HF_NAMES = NameTable(
    globals={"language_model.model.embed_tokens.weight": "embed",
             "language_model.model.norm.weight": "norm",
             "language_model.lm_head.weight": "lm_head"},
    layer_prefix="language_model.model.layers.{i}.", layer=llama.HF_NAMES.layer)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="mistral3")
    g = gguf_get(meta, "mistral3")
    beta = float(g("attention.temperature_scale", 0.0))
    if not beta:
        return config
    original = int(g("rope.scaling.original_context_length"))
    return dataclasses.replace(config, query_temperature=(beta, original))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = dataclasses.replace(mistral.config_from_hf(cfg), architecture="mistral3")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return config
    return dataclasses.replace(
        config, query_temperature=(float(beta), int(params["original_max_position_embeddings"])))


def config_from_multimodal_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The text decoder of Mistral3ForConditionalGeneration."""
    return config_from_hf(multimodal_text_config(
        cfg, "the vision tower and multimodal projector are"))


SPEC = ArchSpec(
    name="mistral3", model_cls=llama.LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=llama.GGUF_NAMES, hf_names=llama.HF_NAMES,
    gguf_transform=llama.SPEC.gguf_transform, hf_architectures=("Ministral3ForCausalLM",))
MULTIMODAL_SPEC = dataclasses.replace(
    SPEC, name="mistral3_multimodal", config_from_hf=config_from_multimodal_hf,
    hf_names=MULTIMODAL_HF_NAMES, hf_architectures=("Mistral3ForConditionalGeneration",))
