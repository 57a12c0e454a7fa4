"""Qwen3: the Llama decoder with RMSNorm on each head's queries and keys (QK-norm) before rope,
and no q/k permutation in GGUF."""

from __future__ import annotations

from functools import partial

from kvlab.models import llama
from kvlab.models.spec import ArchSpec

SPEC = ArchSpec(
    name="qwen3", model_cls=llama.LlamaModel,
    config_from_gguf=partial(llama.config_from_gguf, arch="qwen3"),
    config_from_hf=partial(llama.config_from_hf, arch="qwen3"),
    gguf_names=llama.GGUF_NAMES, hf_names=llama.HF_NAMES,
    hf_architectures=("Qwen3ForCausalLM",))
