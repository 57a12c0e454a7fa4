"""Qwen2: the Llama decoder with a bias on the q/k/v projections and no q/k permutation in GGUF."""

from __future__ import annotations

from functools import partial

from kvlab.models import llama
from kvlab.models.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen2", model_cls=llama.LlamaModel,
    config_from_gguf=partial(llama.config_from_gguf, arch="qwen2"),
    config_from_hf=partial(llama.config_from_hf, arch="qwen2"),
    gguf_names=llama.GGUF_NAMES, hf_names=llama.HF_NAMES,
    hf_architectures=("Qwen2ForCausalLM",))
