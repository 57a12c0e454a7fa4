"""Gemma 4 (text): Gemma 3's decoder with what Gemma 4 adds, each an option of the config or
of a layer's tensors, not a second forward pass:

- per-layer input embeddings (PLE): a second table [vocab, layers * ple_dim] plus a projection
  of the embeddings, mixed once per step; each layer gates its slice into the residual stream
  after the MLP (gelu_tanh(gate(x)) * ple_i, projected back and normed);
- full-attention layers with their own head size, KV heads and proportional RoPE (the first
  quarter of the frequencies of a head_dim-wide rope, the rest zero: those pairs pass
  unrotated), sliding layers with a plain rope of their own;
- KV sharing: the last num_kv_shared_layers layers attend over the K/V of the last earlier
  layer of their kind and write none (ModelConfig.kv_sources: the runner keeps no store for
  them); values equal to keys where a full layer has no v projection (attention_k_eq_v);
- a value RMSNorm without weights, attention scale 1 (the q/k norms set the scale), a learned
  scalar on each layer's output, norms stored as the full multiplier (no 1 + w).

The mixture-of-experts variant (enable_moe_block, 26B-A4B) keeps the dense MLP and adds
routed GeGLU experts beside it on the same residual: the router reads the unnormed residual
(RMSNorm without weights, times its own scale / sqrt(hidden)), softmax, top k renormalised,
times a per-expert scale; the two outputs are normed each, summed, then post-normed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from kvlab.config import ModelConfig, MoeConfig, RopeConfig, hf_layer_types
from kvlab.errors import ModelLoadError
from kvlab.models import decode_c
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.gemma3 import Gemma3Model
from kvlab.models.layers import (
    RopeTable,
    Stacked,
    Weight,
    add_rms_norm,
    embed,
    geglu,
    linear,
    norm_rope,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    split,
)
from kvlab.models.moe import route, run_experts
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, multimodal_text_config

log = logging.getLogger(__name__)

_GGUF_LAYER = {"attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
               "attn_v.weight": "v", "attn_output.weight": "o",
               "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
               "post_attention_norm.weight": "post_attn_norm", "ffn_norm.weight": "mlp_norm",
               "post_ffw_norm.weight": "post_mlp_norm", "ffn_gate.weight": "gate",
               "ffn_up.weight": "up", "ffn_down.weight": "down",
               "inp_gate.weight": "ple_gate", "proj.weight": "ple_out",
               "post_norm.weight": "ple_post_norm", "layer_output_scale.weight": "layer_scalar",
               # mixture of experts: llama.cpp stores the router's scale and the per-expert
               # scale as .scale tensors beside the router and the experts' down
               "ffn_gate_inp.weight": "router", "ffn_gate_inp.scale": "router_scale",
               "ffn_gate_up_exps.weight": "gate_up_exps", "ffn_down_exps.weight": "down_exps",
               "ffn_down_exps.scale": "expert_scale", "pre_ffw_norm_2.weight": "mlp_norm_2",
               "post_ffw_norm_1.weight": "post_mlp_norm_1",
               "post_ffw_norm_2.weight": "post_mlp_norm_2"}
GGUF_NAMES = NameTable(
    globals={"token_embd.weight": "embed", "output_norm.weight": "norm",
             "per_layer_token_embd.weight": "ple_embed",
             "per_layer_model_proj.weight": "ple_proj",
             "per_layer_proj_norm.weight": "ple_norm", "rope_freqs.weight": "rope_freqs"},
    layer_prefix="blk.{i}.", layer=_GGUF_LAYER)

_HF_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
             "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
             "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "q_norm",
             "self_attn.k_norm.weight": "k_norm",
             "post_attention_layernorm.weight": "post_attn_norm",
             "pre_feedforward_layernorm.weight": "mlp_norm",
             "post_feedforward_layernorm.weight": "post_mlp_norm",
             "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
             "mlp.down_proj.weight": "down", "per_layer_input_gate.weight": "ple_gate",
             "per_layer_projection.weight": "ple_out",
             "post_per_layer_input_norm.weight": "ple_post_norm",
             "layer_scalar": "layer_scalar", "router.proj.weight": "router",
             "router.scale": "router_scale", "router.per_expert_scale": "expert_scale",
             "experts.gate_up_proj": "gate_up_exps", "experts.down_proj": "down_exps",
             "pre_feedforward_layernorm_2.weight": "mlp_norm_2",
             "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
             "post_feedforward_layernorm_2.weight": "post_mlp_norm_2"}


def _hf_names(prefix: str) -> NameTable:
    """The text model's names under `prefix` ("model." for Gemma4ForCausalLM,
    "model.language_model." inside Gemma4ForConditionalGeneration)."""
    return NameTable(
        globals={f"{prefix}embed_tokens.weight": "embed", f"{prefix}norm.weight": "norm",
                 f"{prefix}embed_tokens_per_layer.weight": "ple_embed",
                 f"{prefix}per_layer_model_projection.weight": "ple_proj",
                 f"{prefix}per_layer_projection_norm.weight": "ple_norm"},
        layer_prefix=prefix + "layers.{i}.", layer=_HF_LAYER)


HF_NAMES = _hf_names("model.")
MULTIMODAL_HF_NAMES = _hf_names("model.language_model.")


def kv_sources(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it reads: itself, or for the last `num_shared` layers
    the last layer of the same kind before them."""
    first = len(layer_types) - num_shared
    if num_shared <= 0:
        return ()
    out = list(range(len(layer_types)))
    for i in range(first, len(layer_types)):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ModelLoadError(f"layer {i} shares the K/V of an earlier {layer_types[i]} "
                                 f"layer, but none of the first {first} layers is one")
        out[i] = owners[-1]
    return tuple(out)


def proportional_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies of transformers' "proportional" rope: theta **
    (-2j / head_dim) for the first partial * head_dim / 2 pairs, zero (unrotated) after."""
    angles = int(rope.partial * head_dim // 2)
    inv = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim)
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - angles)]) / rope.linear_factor


def _full_layer_override(cfg: dict[str, Any], key: str, types: list[str]) -> int | None:
    """A full-attention layer's `key` in per_layer_config (how transformers saves it)."""
    for i, layer in (cfg.get("per_layer_config") or {}).items():
        if types[int(i)] == "full_attention" and key in layer:
            return int(layer[key])
    return None


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    types = cfg["layer_types"]
    params = cfg["rope_parameters"]
    full, local = params["full_attention"], params["sliding_attention"]
    global_dim = cfg.get("global_head_dim") or _full_layer_override(cfg, "head_dim", types)
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    global_kv = (cfg.get("num_global_key_value_heads") if k_eq_v else None) or \
        _full_layer_override(cfg, "num_key_value_heads", types) or 0
    layer_types = hf_layer_types(types)
    return ModelConfig(
        architecture="gemma4", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=RopeConfig(theta=float(full["rope_theta"]),
                        partial=float(full.get("partial_rotary_factor", 1.0)),
                        linear_factor=float(full.get("factor", 1.0))),
        local_rope=RopeConfig(theta=float(local["rope_theta"])),
        sliding_window=cfg.get("sliding_window"), layer_types=layer_types,
        tie_word_embeddings=True, qk_norm=True, attn_scale=1.0,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        global_head_dim=int(global_dim or 0), global_kv_heads=int(global_kv),
        kv_sources=kv_sources(layer_types, int(cfg.get("num_kv_shared_layers") or 0)),
        global_values_from_keys=k_eq_v, name=cfg.get("_name_or_path", "gemma4"),
        moe=_hf_moe(cfg))


def _hf_moe(cfg: dict[str, Any]) -> MoeConfig | None:
    if not cfg.get("enable_moe_block"):
        return None
    return MoeConfig(num_experts=int(cfg["num_experts"]),
                     experts_per_token=int(cfg["top_k_experts"]),
                     expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                     norm_topk_prob=True)


def config_from_multimodal_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The text model of Gemma4ForConditionalGeneration."""
    return config_from_hf(multimodal_text_config(cfg, "the vision and audio towers are"))


def _per_layer(value: Any, layer_types: tuple[str, ...], full: bool) -> int:
    """A GGUF key written as one number or as one per layer: the value of a full (or a
    sliding) layer."""
    if not isinstance(value, list | tuple):
        return int(value)
    picks = [v for v, t in zip(value, layer_types) if (t == "full") == full]
    return int(picks[0] if picks else value[0])


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "gemma4")
    layers = int(g("block_count"))
    swa = list(g("attention.sliding_window_pattern"))
    layer_types = tuple("sliding" if s else "full" for s in swa[:layers])
    kv = g("attention.head_count_kv")
    full_dim, swa_dim = int(g("attention.key_length")), int(g("attention.key_length_swa"))
    rot_full = int(g("rope.dimension_count", full_dim))
    return ModelConfig(
        architecture="gemma4", vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=int(g("embedding_length")), num_layers=layers,
        num_heads=_per_layer(g("attention.head_count"), layer_types, False),
        num_kv_heads=_per_layer(kv, layer_types, False), head_dim=swa_dim,
        intermediate_size=_per_layer(g("feed_forward_length"), layer_types, False),
        max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        # llama.cpp's converter writes the full layers' rope head_dim wide (its unrotated
        # pairs are rope_freqs factors of 1e30, read by the model)
        rope=RopeConfig(theta=float(g("rope.freq_base", 1e6)), partial=rot_full / full_dim),
        local_rope=RopeConfig(theta=float(g("rope.freq_base_swa", 10000.0))),
        sliding_window=int(g("attention.sliding_window")), layer_types=layer_types,
        tie_word_embeddings=True, qk_norm=True, attn_scale=1.0,
        final_logit_softcapping=g("final_logit_softcapping", None),
        global_head_dim=full_dim, global_kv_heads=_per_layer(kv, layer_types, True),
        kv_sources=kv_sources(layer_types, int(g("attention.shared_kv_layers", 0))),
        # GGUF says nothing of attention_k_eq_v: a full layer without attn_v reads its keys
        global_values_from_keys=True, name=str(meta.get("general.name", "gemma4")),
        moe=_gguf_moe(g))


def _gguf_moe(g: Any) -> MoeConfig | None:
    count = int(g("expert_count", 0))
    if not count:
        return None
    return MoeConfig(num_experts=count, experts_per_token=int(g("expert_used_count")),
                     expert_intermediate_size=int(g("expert_feed_forward_length")),
                     norm_topk_prob=True)


class Gemma4Model(Gemma3Model):
    """Gemma3Model's weights and logits; the forward pass adds the per-layer inputs, each
    layer's own head size, rope and K/V store (or another layer's), and the layer scalars.
    Decode steps run in the one C call where the plan takes every layer (decode_c: the
    per-layer inputs computed here once per step, handed over as rows); tensor parallel is
    not used."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ModelLoadError("Gemma 4 does not run under tensor parallel")
        self.config, self.weights, self.tp = config, weights, tp
        self.layers = [_geglu_experts(_stack_keys(layer)) for layer in layers]
        device = weights["norm"].device
        full = proportional_inv_freq(config.rope, config.layer_head_dim(_first_full(config)))
        if "rope_freqs" in weights:  # GGUF: 1e30 past the rotated pairs -> 0
            full = torch.where(weights["rope_freqs"].cpu() >= 1e29, 0.0,
                               full / weights["rope_freqs"].float().cpu())
        limit = config.max_position_embeddings  # cos/sin kept by position (RopeTable)
        self.inv_freq_global = RopeTable(full.to(device), limit)
        self.inv_freq_local = RopeTable(rope_inv_freq(config.local_rope or config.rope,
                                                      config.head_dim).to(device), limit)
        self.embed_scale = config.hidden_size ** 0.5
        # the value norm has no weights: a multiplier of ones per head size
        self.unit = {d: torch.ones(d, device=device)
                     for d in {config.layer_head_dim(i) for i in range(config.num_layers)}}
        self.plan_layers = [self._plan_layer(i, layer) for i, layer in enumerate(self.layers)]
        self.c_plan = decode_c.build_plan(config, self.plan_layers, "gelu_tanh")

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVStore | None], meta: AttentionMetadata,
                trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        """ids, positions: [T] -> final hidden states [T, hidden] (before the final norm);
        `trace`: a list the MoE layers append their chosen expert ids [T, k] to."""
        c = self.config
        x = embed(ids, self.weights["embed"]) * self.embed_scale
        per_layer = self._per_layer_inputs(ids, x)  # [T, layers, ple_dim] or None
        ropes = {False: rope_cos_sin(positions, self.inv_freq_global),
                 True: rope_cos_sin(positions, self.inv_freq_local)}
        if self.c_plan is not None and trace is None and decode_c.run(
                self.c_plan, c, x, ropes, kv_caches, meta,
                None if per_layer is None else per_layer.reshape(x.shape[0], -1).contiguous()):
            return x
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps)
            h = self.layer_attention(h, layer, ropes[c.is_sliding(i)],
                                     kv_caches[c.kv_source(i)], meta, i)
            x = add_rms_norm(x, h, layer["post_attn_norm"], c.rms_norm_eps)
            x = add_rms_norm(x, self.mlp(x, layer, trace), layer["post_mlp_norm"],
                             c.rms_norm_eps)
            if per_layer is not None:
                # gelu_tanh(gate(x)) * the layer's input: GeGLU on the two side by side
                h = geglu(torch.cat([linear(x, layer["ple_gate"]), per_layer[:, i]], dim=-1))
                x = add_rms_norm(x, linear(h, layer["ple_out"]), layer["ple_post_norm"],
                                 c.rms_norm_eps)
            if "layer_scalar" in layer:
                x = x * layer["layer_scalar"]
        return x

    def mlp(self, x: torch.Tensor, layer: dict[str, Weight],
            trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The residual x [T, hidden] -> the MLP's output before the post norm: the dense
        GeGLU, plus (MoE layers) the routed experts, each output normed."""
        eps = self.config.rms_norm_eps
        h = linear(geglu(linear(rms_norm(x, layer["mlp_norm"], eps), layer["gate_up"])),
                   layer["down"])
        if "experts" not in layer:
            return h
        # the router's RMSNorm has no weights: its scale / sqrt(hidden) is the multiplier
        weights, ids = route(rms_norm(x, layer["router_scale"] * x.shape[-1] ** -0.5, eps),
                             layer["router"], self.config.moe)
        if trace is not None:
            trace.append(ids)
        weights = weights * layer["expert_scale"][ids].to(weights.dtype)
        routed = run_experts(rms_norm(x, layer["mlp_norm_2"], eps), layer["experts"],
                             weights, ids)
        return (rms_norm(h, layer["post_mlp_norm_1"], eps)
                + rms_norm(routed, layer["post_mlp_norm_2"], eps))

    def _plan_layer(self, i: int, layer: dict) -> dict:
        """Layer i as the one-call plan reads it (decode_c): the value norm's ones where it
        owns its K/V; in a MoE layer the dense MLP in the shared expert's place and the
        router's, the experts' and the two outputs' norms under the plan's names."""
        out = dict(layer)
        if self.config.owns_kv(i):
            out["v_norm"] = self.unit[self.config.layer_head_dim(i)]
        if "experts" in layer:
            out.update(shexp_gate_up=layer["gate_up"], shexp_down=layer["down"],
                       router_norm=layer["router_scale"] * self.config.hidden_size ** -0.5,
                       experts_norm=layer["mlp_norm_2"],
                       shexp_out_norm=layer["post_mlp_norm_1"],
                       experts_out_norm=layer["post_mlp_norm_2"])
        return out

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """PLE: (norm(proj(x) / sqrt(hidden)) + table[ids] * sqrt(ple_dim)) / sqrt(2), as
        [T, layers, ple_dim]; x is the scaled embedding."""
        table = self.weights.get("ple_embed")
        if table is None:
            return None
        c = self.config
        dim = table.shape[1] // c.num_layers
        tokens = embed(ids, table).reshape(-1, c.num_layers, dim) * dim ** 0.5
        proj = linear(x, self.weights["ple_proj"]) * c.hidden_size ** -0.5
        proj = rms_norm(proj.reshape(-1, c.num_layers, dim).contiguous(),
                        self.weights["ple_norm"], c.rms_norm_eps)
        return (proj + tokens) * 2 ** -0.5

    def layer_attention(self, h: torch.Tensor, layer: dict[str, Weight],
                        rope: tuple[torch.Tensor, torch.Tensor], cache: KVStore,
                        meta: AttentionMetadata, i: int) -> torch.Tensor:
        """Layer i's attention over its own K/V store, or (k, v None) over the store of the
        layer it shares with, which this step's tokens were written to already."""
        c = self.config
        dim, kv_heads = c.layer_head_dim(i), c.layer_kv_heads(i)
        q, k, v = _projections(h, layer)
        q = norm_rope(q.reshape(-1, c.num_heads, dim), layer["q_norm"], *rope, c.rms_norm_eps)
        if c.owns_kv(i):
            v = rms_norm(v.reshape(-1, kv_heads, dim), self.unit[dim], c.rms_norm_eps)
            k = norm_rope(k.reshape(-1, kv_heads, dim), layer["k_norm"], *rope, c.rms_norm_eps)
        else:
            k = v = None
        out = paged_attention(q, k, v, cache, meta, sliding=c.is_sliding(i), scale=c.scale)
        return linear(out, layer["o"])


def _projections(h: torch.Tensor, layer: dict[str, Weight]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q, k, v of a layer's products; v is k where it has no v projection, k and v None
    where it has q alone."""
    if "qkv" in layer:
        return split(linear(h, layer["qkv"]), layer["qkv"])
    if "qk" in layer:
        q, k = split(linear(h, layer["qk"]), layer["qk"])
        return q, k, k
    return linear(h, layer["q"]), None, None


def _stack_keys(layer: dict[str, Weight]) -> dict[str, Weight | Stacked]:
    """q and k as one product where a layer has no v (the loader stacks q|k|v only)."""
    if "qkv" in layer or "k" not in layer:
        return layer
    out = dict(layer)
    out["qk"] = Stacked.of([out.pop("q"), out.pop("k")])
    return out


def _geglu_experts(layer: dict) -> dict:
    """A MoE layer's experts run GeGLU (moe.Experts' gate), not SwiGLU."""
    if "experts" not in layer:
        return layer
    return {**layer, "experts": dataclasses.replace(layer["experts"], gate=geglu)}


def _first_full(config: ModelConfig) -> int:
    return next((i for i, t in enumerate(config.layer_types) if t == "full"), 0)


SPEC = ArchSpec(
    name="gemma4", model_cls=Gemma4Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("Gemma4ForCausalLM", "Gemma4TextModel"))
MULTIMODAL_SPEC = ArchSpec(
    name="gemma4_multimodal", model_cls=Gemma4Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_multimodal_hf, gguf_names=GGUF_NAMES,
    hf_names=MULTIMODAL_HF_NAMES, hf_architectures=("Gemma4ForConditionalGeneration",))
