"""SmolLM3: the Llama decoder with some layers that add no rotary positions (NoPE layers,
every fourth one in the released models); their queries and keys attend as projected.

HF configs list the layers in `no_rope_layers` (1: the layer uses RoPE, 0: it does not);
llama.cpp's converter writes no such key and its `smollm3` graph fixes the step at 4, so a
GGUF file gets that rule. The one-call C decode plan runs these layers with an identity
rotation table (cos 1, sin 0), which leaves q and k exactly as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.config import ModelConfig, hf_layer_types
from kvlab.models import llama
from kvlab.models.spec import ArchSpec

NO_ROPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step for smollm3


def every_nth_without_rope(num_layers: int, n: int) -> tuple[bool, ...]:
    """Layer i has no RoPE when (i + 1) % n == 0 (transformers' default, llama.cpp's rule)."""
    return tuple((i + 1) % n == 0 for i in range(num_layers))


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_gguf(meta, arch="smollm3")
    return dataclasses.replace(
        config, no_rope_layers=every_nth_without_rope(config.num_layers, NO_ROPE_EVERY))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_hf(cfg, arch="smollm3")
    uses_rope = cfg.get("no_rope_layers")
    no_rope = (tuple(not r for r in uses_rope) if uses_rope is not None else
               every_nth_without_rope(config.num_layers,
                                      cfg.get("no_rope_layer_interval", NO_ROPE_EVERY)))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types")
    return dataclasses.replace(
        config, no_rope_layers=no_rope, sliding_window=window,
        layer_types=hf_layer_types(types) if window and types else config.layer_types)


SPEC = ArchSpec(
    name="smollm3", model_cls=llama.LlamaModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=llama.GGUF_NAMES, hf_names=llama.HF_NAMES,
    gguf_transform=llama.SPEC.gguf_transform, hf_architectures=("SmolLM3ForCausalLM",))
