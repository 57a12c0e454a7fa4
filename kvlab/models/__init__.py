"""Architecture registry: one file per architecture, found by the checkpoint's own name for it."""

from __future__ import annotations

from kvlab.errors import ModelLoadError
from kvlab.models import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from kvlab.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in
                                      (llama.SPEC, gemma3.SPEC, qwen2.SPEC, qwen3.SPEC,
                                       mistral.SPEC, gemma2.SPEC, phi3.SPEC)}
_HF_NAMES = {hf: s for s in ARCHITECTURES.values() for hf in s.hf_architectures}


def find_arch(name: str) -> ArchSpec:
    """A GGUF `general.architecture` or an HF `architectures[0]` / `model_type` -> spec."""
    spec = ARCHITECTURES.get(name) or _HF_NAMES.get(name)
    if spec is None and name.endswith("_text"):
        spec = ARCHITECTURES.get(name.removesuffix("_text"))
    if spec is None:
        valid = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"architecture {name!r} is not supported (valid: {valid})")
    return spec
