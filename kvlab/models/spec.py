"""What an architecture file declares: config parsers, checkpoint name tables, the model class."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.config import LongRope, ModelConfig, RopeConfig, Yarn, yarn_mscale
from kvlab.errors import ModelLoadError

log = logging.getLogger("kvlab.models")

_MISSING = object()


@dataclass(frozen=True)
class NameTable:
    """Checkpoint tensor names -> kvlab names, for global tensors and per-layer tensors."""

    globals: dict[str, str]
    layer_prefix: str  # e.g. "blk.{i}."
    layer: dict[str, str]
    # one 2-D matrix per expert, "{e}" the expert's index (HF MoE checkpoints); GGUF stacks
    # a layer's experts into one 3-D tensor, named in `layer`
    experts: dict[str, str] = field(default_factory=dict)


def _identity(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class ArchSpec:
    name: str
    model_cls: type
    config_from_gguf: Callable[[dict[str, Any]], ModelConfig]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    gguf_names: NameTable
    hf_names: NameTable
    # fix-ups applied to a tensor's rows at load, by kvlab name (q/k permutation, norm offset)
    gguf_transform: Callable[[ModelConfig, str, torch.Tensor], torch.Tensor] = _identity
    hf_transform: Callable[[ModelConfig, str, torch.Tensor], torch.Tensor] = _identity
    hf_architectures: tuple[str, ...] = field(default_factory=tuple)
    # checkpoints that store q|k|v or gate|up as one matrix (kvlab name "qkv" / "gate_up"):
    # the out features of each original matrix, for splitting the product
    fused_sizes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
    # (GGUF architecture, test of its metadata): files another family's converter writes
    # under that name which belong here (Mixtral: `llama` with experts)
    gguf_variant_of: tuple[str, Callable[[dict[str, Any]], bool]] | None = None
    # the MLP's products: gate, up and down (SwiGLU / GeGLU), or up and down alone (BERT)
    gated_mlp: bool = True
    # routed experts without a gate product (up, this activation, down: Nemotron-H's
    # squared ReLU); None: each expert's gate|up feeds SwiGLU
    expert_activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    # how embeddings pool the final hidden states when the checkpoint does not say
    # (kvlab.models.pooling): decoders take the last token
    pooling: str = "last"
    # HF names of the multi-token-prediction layer where the checkpoint stores it apart from
    # the main layers (Qwen3.5's mtp.*); None: as layer num_layers (kvlab.models.mtp)
    hf_mtp_names: NameTable | None = None


def gguf_get(meta: dict[str, Any], arch: str) -> Callable[..., Any]:
    """Reader of `{arch}.{key}` metadata that says which key is missing."""

    def get(key: str, default: Any = _MISSING) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks required key {full!r}")
        return default

    return get


def hf_rope(cfg: dict[str, Any]) -> RopeConfig:
    """RopeConfig from an HF config's rope_theta / rope_scaling (or rope_parameters)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                  float(scaling["high_freq_factor"]),
                  int(scaling["original_max_position_embeddings"]))
        return RopeConfig(theta=theta, llama3=llama3)
    if kind == "linear":
        return RopeConfig(theta=theta, linear_factor=float(scaling["factor"]))
    if kind in ("longrope", "su"):
        return RopeConfig(theta=theta, longrope=_hf_longrope(cfg, scaling))
    if kind == "yarn":
        return RopeConfig(theta=theta, yarn=hf_yarn(cfg, scaling))
    if kind not in ("default", None):
        raise ModelLoadError(f"rope scaling {kind!r} is not supported "
                             "(valid: default, linear, llama3, longrope, yarn)")
    return RopeConfig(theta=theta)


def hf_yarn(cfg: dict[str, Any], scaling: dict[str, Any]) -> Yarn:
    """YaRN as transformers reads it: factor given or max_position_embeddings / original;
    the attention factor given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    where both are set, else mscale(factor)."""
    original = scaling.get("original_max_position_embeddings",
                           cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("yarn rope scaling needs original_max_position_embeddings")
    factor = float(scaling.get("factor") or cfg["max_position_embeddings"] / original)
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    return Yarn(factor, int(original), float(attention),
                float(scaling.get("beta_fast") or 32.0), float(scaling.get("beta_slow") or 1.0),
                bool(scaling.get("truncate", True)))


def _hf_longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> LongRope:
    """Longrope as transformers reads it: the config's own original_max_position_embeddings
    first; the attention factor given, or sqrt(1 + ln(s) / ln(original)) for the context
    scale s = max_position_embeddings / original (1 when s <= 1)."""
    original = cfg.get("original_max_position_embeddings",
                       scaling.get("original_max_position_embeddings"))
    if original is None or "short_factor" not in scaling or "long_factor" not in scaling:
        raise ModelLoadError("longrope scaling needs original_max_position_embeddings, "
                             "short_factor and long_factor")
    factor = scaling.get("factor") or cfg["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(int(original), float(attention), tuple(map(float, scaling["short_factor"])),
                    tuple(map(float, scaling["long_factor"])))


def gguf_rope(g: Callable[..., Any]) -> RopeConfig:
    """RopeConfig from `{arch}.rope.*` metadata (g: gguf_get's reader): theta, and linear or
    YaRN scaling. YaRN's attention factor as llama.cpp derives it: mscale(factor) /
    mscale(factor, yarn_log_multiplier) where a multiplier is written, else mscale(factor),
    times rope.scaling.attn_factor."""
    theta = float(g("rope.freq_base", 10000.0))
    kind, factor = g("rope.scaling.type", "none"), float(g("rope.scaling.factor", 1.0))
    if kind == "linear":
        return RopeConfig(theta=theta, linear_factor=factor)
    if kind != "yarn" or factor <= 1:
        return RopeConfig(theta=theta)
    log_mul = float(g("rope.scaling.yarn_log_multiplier", 0.0))
    attention = (yarn_mscale(factor) / yarn_mscale(factor, log_mul) if log_mul
                 else yarn_mscale(factor))
    attention *= float(g("rope.scaling.attn_factor", 1.0))
    return RopeConfig(theta=theta, yarn=Yarn(
        factor, int(g("rope.scaling.original_context_length")), attention,
        float(g("rope.scaling.yarn_beta_fast", 32.0)), float(g("rope.scaling.yarn_beta_slow", 1.0))))


def multimodal_text_config(cfg: dict[str, Any],
                           towers: str = "the vision tower is") -> dict[str, Any]:
    """The text model's HF config inside a multimodal checkpoint's (`text_config`), with the
    wrapper's name and embedding tie (the wrapper's, where it says); logs that `towers`
    (what the checkpoint holds besides the text model) are not loaded."""
    text = cfg.get("text_config")
    name = cfg.get("_name_or_path") or (cfg.get("architectures") or ["multimodal model"])[0]
    if not text:
        raise ModelLoadError(f"{name}: a multimodal config without text_config")
    log.warning("%s: loading the text model only; %s not loaded (only text inputs are "
                "supported)", name, towers)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "_name_or_path": name, "tie_word_embeddings": tied}

