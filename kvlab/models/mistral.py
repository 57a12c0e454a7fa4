"""Mistral: the Llama decoder, with sliding-window attention on every layer when the config
sets a window (Mistral 7B v0.1: 4,096 tokens; later versions none). llama.cpp writes these
models as GGUF architecture `llama`, so only the HF name lands here."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from kvlab.config import ModelConfig
from kvlab.models import llama
from kvlab.models.spec import ArchSpec


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_hf(cfg, arch="mistral")
    window = cfg.get("sliding_window")
    if not window:
        return config
    return dataclasses.replace(config, sliding_window=int(window),
                               layer_types=("sliding",) * config.num_layers)


SPEC = ArchSpec(
    name="mistral", model_cls=llama.LlamaModel,
    config_from_gguf=partial(llama.config_from_gguf, arch="mistral"),
    config_from_hf=config_from_hf, gguf_names=llama.GGUF_NAMES, hf_names=llama.HF_NAMES,
    gguf_transform=llama.SPEC.gguf_transform, hf_architectures=("MistralForCausalLM",))
