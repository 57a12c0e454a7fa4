"""Architecture registry: one file per architecture, found by the checkpoint's own name for it."""

from __future__ import annotations

from typing import Any

from kvlab.errors import ModelLoadError
from kvlab.models import (
    bert,
    deepseek2,
    gemma2,
    gemma3,
    gemma4,
    glm4moe,
    gpt_oss,
    granite_hybrid,
    lfm2,
    llama,
    mistral,
    mistral3,
    mixtral,
    nemotron_h,
    nomic_bert,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3_5,
    qwen3moe,
    smollm3,
)
from kvlab.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in
                                      (llama.SPEC, gemma3.SPEC, qwen2.SPEC, qwen3.SPEC,
                                       mistral.SPEC, gemma2.SPEC, phi3.SPEC, qwen3moe.SPEC,
                                       qwen2moe.SPEC, mixtral.SPEC, olmoe.SPEC, bert.SPEC,
                                       nomic_bert.SPEC, lfm2.SPEC, lfm2.MOE_SPEC,
                                       lfm2.MULTIMODAL_SPEC, qwen3_5.SPEC,
                                       qwen3_5.MOE_SPEC, qwen3_5.MULTIMODAL_SPEC,
                                       qwen3_5.MOE_MULTIMODAL_SPEC,
                                       granite_hybrid.SPEC, nemotron_h.SPEC,
                                       nemotron_h.MOE_SPEC,
                                       smollm3.SPEC, olmo2.SPEC, mistral3.SPEC,
                                       mistral3.MULTIMODAL_SPEC, glm4moe.SPEC,
                                       gpt_oss.SPEC, gemma4.SPEC, gemma4.MULTIMODAL_SPEC,
                                       deepseek2.SPEC)}
_HF_NAMES = {hf: s for s in ARCHITECTURES.values() for hf in s.hf_architectures}
_GGUF_VARIANTS = [s for s in ARCHITECTURES.values() if s.gguf_variant_of]


def find_arch(name: str, gguf_metadata: dict[str, Any] | None = None) -> ArchSpec:
    """A GGUF `general.architecture` or an HF `architectures[0]` / `model_type` -> spec; with
    a GGUF file's metadata, a family written under another's name (Mixtral as `llama`)."""
    for variant in _GGUF_VARIANTS if gguf_metadata is not None else ():
        base, matches = variant.gguf_variant_of
        if name == base and matches(gguf_metadata):
            return variant
    spec = ARCHITECTURES.get(name) or _HF_NAMES.get(name)
    if spec is None and name.endswith("_text"):
        spec = ARCHITECTURES.get(name.removesuffix("_text"))
    if spec is None:
        valid = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"architecture {name!r} is not supported (valid: {valid})")
    return spec
