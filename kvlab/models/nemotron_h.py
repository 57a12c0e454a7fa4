"""Nemotron-H (NemotronHForCausalLM; llama.cpp's `nemotron_h` and `nemotron_h_moe`): a stack
of single-sublayer blocks, each one of Mamba-2 ("M"), attention ("*"), an MLP ("-") or, in
the Nemotron-3 MoE variants, routed experts ("E"):

    x += mixer(norm(x))          one norm and one mixer per layer, nothing after it

so an MLP layer keeps neither KV nor a state (layer kind "mlp"; config.mlp_after_mixer
false). The MLP is squared ReLU without a gate, down(relu(up(h))^2). The experts are the
same ungated relu2 MLPs, routed by sigmoid scores with a choice bias (as DeepSeek-V3:
kvlab.models.moe.route_sigmoid), beside a shared relu2 expert; Nemotron-3 Super runs its
experts in a narrower latent (latent_in, then latent_out). The Mamba-2 mixer (grouped B
and C, the gated RMSNorm per group) and the attention without RoPE are Granite 4 hybrid's
(kvlab.models.granite_hybrid, its multipliers all 1 here).

The layer pattern: HF's `hybrid_override_pattern` ("M-M*-...", as NVIDIA's checkpoints
write it) or `layers_block_type` (transformers' names). In GGUF a layer is Mamba-2 where
both its `attention.head_count_kv` and `feed_forward_length` entries are 0, attention where
only its feed-forward entry is, else an MLP (or experts, in nemotron_h_moe): llama.cpp's rule.
The multi-token-prediction layers (GGUF nextn_predict_layers, HF mtp.*) are not run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from kvlab.config import (
    HF_LAYER_TYPES,
    PATTERN_LAYER_TYPES,
    ModelConfig,
    MoeConfig,
    hf_layer_types,
)
from kvlab.errors import ModelLoadError
from kvlab.models import granite_hybrid, llama, moe
from kvlab.models.granite_hybrid import (
    MAMBA2_GGUF,
    GraniteHybridModel,
    json_float,
    mamba2_config,
    mamba2_hf_transform,
)
from kvlab.models.layers import Stacked, linear, relu2
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, **MAMBA2_GGUF, "ssm_in.bias": "in_proj_bias",
           "ssm_out.bias": "out_proj_bias",
           "ffn_up.bias": "up_bias", "ffn_down.bias": "down_bias",
           "ffn_gate_inp.weight": "router", "exp_probs_b.bias": "router_bias",
           "ffn_up_exps.weight": "up_exps", "ffn_down_exps.weight": "down_exps",
           "ffn_up_shexp.weight": "shexp_up", "ffn_down_shexp.weight": "shexp_down",
           "ffn_latent_down.weight": "latent_in", "ffn_latent_up.weight": "latent_out"})
HF_NAMES = NameTable(
    globals={"backbone.embeddings.weight": "embed", "backbone.norm_f.weight": "norm",
             "lm_head.weight": "lm_head"},
    layer_prefix="backbone.layers.{i}.",
    layer={"norm.weight": "attn_norm",
           **{f"mixer.{n}": d for n, d in (
               ("in_proj.weight", "in_proj"), ("in_proj.bias", "in_proj_bias"),
               ("conv1d.weight", "conv"), ("conv1d.bias", "conv_bias"),
               ("dt_bias", "dt_bias"), ("A_log", "ssm_a"), ("D", "D"),
               ("norm.weight", "norm"), ("out_proj.weight", "out_proj"),
               ("out_proj.bias", "out_proj_bias"),
               ("q_proj.weight", "q"), ("k_proj.weight", "k"), ("v_proj.weight", "v"),
               ("o_proj.weight", "o"), ("up_proj.weight", "up"), ("up_proj.bias", "up_bias"),
               ("down_proj.weight", "down"), ("down_proj.bias", "down_bias"),
               ("gate.weight", "router"), ("gate.e_score_correction_bias", "router_bias"),
               # transformers' in-memory layout: every expert in one [E, out, in] tensor
               ("experts.up_proj", "up_exps"), ("experts.down_proj", "down_exps"),
               ("shared_experts.up_proj.weight", "shexp_up"),
               ("shared_experts.down_proj.weight", "shexp_down"),
               ("fc1_latent_proj.weight", "latent_in"),
               ("fc2_latent_proj.weight", "latent_out"))}},
    experts={"mixer.experts.{e}.up_proj.weight": "up_exps",
             "mixer.experts.{e}.down_proj.weight": "down_exps"})


def _kinds(pattern: str | list[str]) -> tuple[tuple[str, ...], bool]:
    """An HF layer pattern -> (kvlab layer kinds, whether any layer runs routed experts)."""
    valid = PATTERN_LAYER_TYPES if isinstance(pattern, str) else HF_LAYER_TYPES
    unknown = sorted({str(p) for p in pattern} - set(valid))
    if unknown:
        raise ModelLoadError(f"nemotron_h layer pattern has {unknown}; valid: {sorted(valid)}")
    return hf_layer_types(pattern), any(p in ("E", "moe") for p in pattern)


def _config(arch: str, *, layer_types: tuple[str, ...], experts: MoeConfig | None,
            **fields: Any) -> ModelConfig:
    layers = len(layer_types)
    return ModelConfig(architecture=arch, num_layers=layers, layer_types=layer_types,
                       moe=experts, mlp_after_mixer=False, no_rope_layers=(True,) * layers,
                       **fields)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    if not pattern:
        raise ModelLoadError("a nemotron_h config needs hybrid_override_pattern or "
                             "layers_block_type (one entry per layer)")
    types, routed = _kinds(pattern)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    ssm_heads = cfg["mamba_num_heads"]
    experts = MoeConfig(
        num_experts=cfg["n_routed_experts"], experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=cfg.get("moe_shared_expert_intermediate_size", 0),
        scoring="sigmoid", groups=cfg.get("n_group", 1), top_groups=cfg.get("topk_group", 1),
        routed_scale=float(cfg.get("routed_scaling_factor", 1.0))) if routed else None
    limit = tuple(map(json_float, cfg.get("time_step_limit") or (0.0, math.inf)))
    return _config(
        "nemotron_h_moe" if routed else "nemotron_h", layer_types=types, experts=experts,
        vocab_size=cfg["vocab_size"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        # NVIDIA's first checkpoints name it attention_head_dim
        head_dim=cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size", 0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=cfg.get("_name_or_path", "nemotron_h"),
        recurrent=mamba2_config(
            kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)), heads=ssm_heads,
            head_dim=cfg["mamba_head_dim"],
            groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 8)),
            state=cfg.get("ssm_state_size", 128), limit=limit))


def _per_layer(value: Any, n: int, key: str) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)] * n
    if len(values) < n:
        raise ModelLoadError(f"{key} has {len(values)} entries for {n} layers")
    return values[:n]


def config_from_gguf(meta: dict[str, Any], arch: str = "nemotron_h") -> ModelConfig:
    g = gguf_get(meta, arch)
    # block_count counts the multi-token-prediction layers at the end: not run
    layers = int(g("block_count")) - int(g("nextn_predict_layers", 0))
    kv = _per_layer(g("attention.head_count_kv"), layers, f"{arch}.attention.head_count_kv")
    ff = _per_layer(g("feed_forward_length"), layers, f"{arch}.feed_forward_length")
    types = tuple("full" if f == 0 and k else "recurrent" if f == 0 else "mlp"
                  for k, f in zip(kv, ff))
    heads = max(_per_layer(g("attention.head_count"), layers, f"{arch}.attention.head_count"))
    ssm_heads, inner = int(g("ssm.time_step_rank")), int(g("ssm.inner_size"))
    if inner % ssm_heads:
        raise ModelLoadError(f"{arch}.ssm.inner_size {inner} is not a multiple of "
                             f"ssm.time_step_rank {ssm_heads} (SSM heads)")
    experts = None
    if int(g("expert_count", 0)):
        experts = dataclasses.replace(
            moe.moe_from_gguf(meta, arch, norm_topk_prob=True), scoring="sigmoid",
            groups=int(g("expert_group_count", 1)), top_groups=int(g("expert_group_used_count", 1)),
            routed_scale=float(g("expert_weights_scale", 1.0)))
    hidden = int(g("embedding_length"))
    eps = g("attention.layer_norm_rms_epsilon", None) or g("attention.layer_norm_epsilon", 1e-5)
    vocab = g("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    return _config(
        arch, layer_types=types, experts=experts, vocab_size=int(vocab), hidden_size=hidden,
        num_heads=heads, num_kv_heads=max(kv) or heads,
        head_dim=int(g("attention.key_length", hidden // heads)),
        intermediate_size=max(ff), max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(eps), tie_word_embeddings=True,  # untied where output.weight is
        name=str(meta.get("general.name", arch)),
        recurrent=mamba2_config(kernel=int(g("ssm.conv_kernel")), heads=ssm_heads,
                                head_dim=inner // ssm_heads, groups=int(g("ssm.group_count")),
                                state=int(g("ssm.state_size"))))


class NemotronHModel(GraniteHybridModel):
    """Granite 4 hybrid's Mamba-2 and RoPE-less attention (kvlab.models.granite_hybrid; all
    its multipliers 1 here), one mixer per layer, and relu2 MLPs: dense, or routed experts
    beside a shared one."""

    plan_gate = "relu2"

    def plan_layers(self) -> list[dict[str, Any]]:
        """The layers as the C plan names them (up alone as the MLP's and the shared
        expert's gate_up)."""
        return [{**layer, **{f"{pre}gate_up": Stacked.of([layer[f"{pre}up"]])
                             for pre in ("", "shexp_") if f"{pre}up" in layer}}
                for layer in self.layers]

    def mlp(self, h: torch.Tensor, layer: dict[str, Any],
            trace: list[torch.Tensor] | None) -> torch.Tensor:
        """down(relu2(up(h))); with a router, the routed experts (in the latent where the
        layer has one) plus the shared expert."""
        if "router" not in layer:
            return linear(relu2(linear(h, layer["up"], layer.get("up_bias"))), layer["down"],
                          layer.get("down_bias"))
        assert self.config.moe is not None
        weights, ids = moe.route_sigmoid(h, layer["router"], layer["router_bias"],
                                         self.config.moe)
        if trace is not None:
            trace.append(ids)
        x = linear(h, layer["latent_in"]) if "latent_in" in layer else h
        out = moe.run_experts(x, layer["experts"], weights, ids)
        if "latent_out" in layer:
            out = linear(out, layer["latent_out"])
        return out + linear(relu2(linear(h, layer["shexp_up"])), layer["shexp_down"])


SPEC = ArchSpec(
    name="nemotron_h", model_cls=NemotronHModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    # as Granite 4 hybrid's: q and k back from llama.cpp's rope row order (its converter
    # permutes them although nothing rotates), A, D and the norm flat
    gguf_transform=granite_hybrid.SPEC.gguf_transform, hf_transform=mamba2_hf_transform,
    hf_architectures=("NemotronHForCausalLM",), gated_mlp=False, expert_activation=relu2)
MOE_SPEC = dataclasses.replace(
    SPEC, name="nemotron_h_moe",
    config_from_gguf=lambda meta: config_from_gguf(meta, "nemotron_h_moe"),
    hf_architectures=())
