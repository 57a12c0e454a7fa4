"""LFM2 (Liquid): a hybrid of short-convolution layers and attention layers, SwiGLU MLPs.

A short-conv layer projects its input to three parts B, C, x, runs a causal depthwise
convolution of width K over B * x and gates the result by C:

    h -> in_proj -> [B | C | x];  y = C * conv(B * x);  out_proj(y)

so its per-sequence state is the last K - 1 inputs of the convolution (kvlab.models.
state_store). Attention layers are Llama's with QK-norm. The final norm is HF's
`embedding_norm` (llama.cpp's `token_embd_norm`), applied after the last layer. Which
layers convolve: HF's `layer_types` ("conv" / "full_attention"); in GGUF, the layers whose
`attention.head_count_kv` entry is 0. LFM2-VL checkpoints (Lfm2VlForConditionalGeneration)
load their text model alone.

LFM2-MoE (Lfm2MoeForCausalLM; llama.cpp's `lfm2moe`): the same layers, the MLPs after the
first `num_dense_layers` (GGUF leading_dense_block_count) mixtures of experts with a sigmoid
router whose per-expert bias counts for the choice only (kvlab.models.moe.route_sigmoid),
the k chosen scores renormalised and scaled by routed_scaling_factor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.config import ModelConfig, MoeConfig, RecurrentConfig, RopeConfig, hf_layer_types
from kvlab.errors import ModelLoadError
from kvlab.kernels.recurrent import short_conv
from kvlab.models import decode_c, moe
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.hybrid import HybridModel
from kvlab.models.layers import RopeTable, Weight, linear, norm_rope, rope_inv_freq, split
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, multimodal_text_config
from kvlab.models.state_store import LayerState, StateBatch

GGUF_NAMES = NameTable(
    globals={"token_embd.weight": "embed", "token_embd_norm.weight": "norm",
             "output.weight": "lm_head"},
    layer_prefix="blk.{i}.",
    layer={"attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
           "attn_v.weight": "v", "attn_output.weight": "o", "attn_q_norm.weight": "q_norm",
           "attn_k_norm.weight": "k_norm", "shortconv.in_proj.weight": "conv_in",
           "shortconv.conv.weight": "conv", "shortconv.out_proj.weight": "conv_out",
           "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up",
           "ffn_down.weight": "down", "ffn_gate_inp.weight": "router",
           "exp_probs_b.bias": "router_bias", "ffn_gate_exps.weight": "gate_exps",
           "ffn_up_exps.weight": "up_exps", "ffn_down_exps.weight": "down_exps"},
)
HF_NAMES = NameTable(
    globals={"model.embed_tokens.weight": "embed", "model.embedding_norm.weight": "norm",
             "lm_head.weight": "lm_head"},
    layer_prefix="model.layers.{i}.",
    layer={"operator_norm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
           "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
           "self_attn.out_proj.weight": "o", "self_attn.q_layernorm.weight": "q_norm",
           "self_attn.k_layernorm.weight": "k_norm", "conv.in_proj.weight": "conv_in",
           "conv.in_proj.bias": "conv_in_bias", "conv.conv.weight": "conv",
           "conv.conv.bias": "conv_bias", "conv.out_proj.weight": "conv_out",
           "conv.out_proj.bias": "conv_out_bias", "ffn_norm.weight": "mlp_norm",
           "feed_forward.w1.weight": "gate", "feed_forward.w3.weight": "up",
           "feed_forward.w2.weight": "down", "feed_forward.gate.weight": "router",
           "feed_forward.expert_bias": "router_bias"},
    experts={"feed_forward.experts.{e}.w1.weight": "gate_exps",
             "feed_forward.experts.{e}.w3.weight": "up_exps",
             "feed_forward.experts.{e}.w2.weight": "down_exps"},
)


def config_from_gguf(meta: dict[str, Any], arch: str = "lfm2") -> ModelConfig:
    g = gguf_get(meta, arch)
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    kv = g("attention.head_count_kv")
    layers = int(g("block_count"))
    kv_heads = [int(n) for n in kv] if isinstance(kv, list | tuple) else [int(kv)] * layers
    if len(kv_heads) != layers or not any(kv_heads):
        raise ModelLoadError(f"{arch}.attention.head_count_kv {kv!r}: need one entry per layer "
                             f"({layers}), 0 for a convolution layer, and one attention layer")
    vocab = g("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    return _config(
        vocab=int(vocab), hidden=hidden, heads=heads, kv_heads=max(kv_heads),
        layer_types=tuple("recurrent" if n == 0 else "full" for n in kv_heads),
        intermediate=int(g("feed_forward_length")), context=int(g("context_length")),
        eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        theta=float(g("rope.freq_base", 1e6)), kernel=int(g("shortconv.l_cache")),
        tied=True, name=str(meta.get("general.name", arch)),
        experts=_gguf_experts(meta) if arch == "lfm2moe" else None)


def _gguf_experts(meta: dict[str, Any]) -> MoeConfig:
    g = gguf_get(meta, "lfm2moe")
    experts = moe.moe_from_gguf(meta, "lfm2moe", norm_topk_prob=True)
    scale = float(g("expert_weights_scale", 1.0)) or 1.0  # 0: not written, no scaling
    return MoeConfig(experts.num_experts, experts.experts_per_token,
                     experts.expert_intermediate_size, experts.norm_topk_prob,
                     scoring="sigmoid", routed_scale=scale)


def _ffn_width(cfg: dict[str, Any]) -> int:
    """The MLP width as transformers' Lfm2MLP computes it (block_auto_adjust_ff_dim)."""
    width = cfg.get("block_ff_dim", cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier, multiple = cfg.get("block_ffn_dim_multiplier", 1.0), cfg.get("block_multiple_of", 256)
    if multiplier is not None:
        width = int(multiplier * width)
    return multiple * ((width + multiple - 1) // multiple)


# Lfm2VlForConditionalGeneration: the text model under model.language_model
MULTIMODAL_HF_NAMES = NameTable(
    globals={"model.language_model.embed_tokens.weight": "embed",
             "model.language_model.embedding_norm.weight": "norm",
             "lm_head.weight": "lm_head"},
    layer_prefix="model.language_model.layers.{i}.", layer=HF_NAMES.layer)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """LFM2 and LFM2-MoE (num_experts set: its dense MLPs are intermediate_size wide)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if i in (cfg.get("full_attn_idxs") or range(layers)) else "conv"
        for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    return _config(
        vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"], layer_types=hf_layer_types(types),
        intermediate=cfg["intermediate_size"] if cfg.get("num_experts") else _ffn_width(cfg),
        context=cfg.get("max_position_embeddings", 128000),
        eps=cfg.get("norm_eps", 1e-5),
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 1e6))),
        kernel=cfg.get("conv_L_cache", 3),
        tied=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        name=cfg.get("_name_or_path", "lfm2"), experts=_hf_experts(cfg))


def _hf_experts(cfg: dict[str, Any]) -> MoeConfig | None:
    """LFM2-MoE's experts (which layers have them: those whose checkpoint has a router)."""
    if not cfg.get("num_experts"):
        return None
    return MoeConfig(num_experts=cfg["num_experts"],
                     experts_per_token=cfg["num_experts_per_tok"],
                     expert_intermediate_size=cfg["moe_intermediate_size"],
                     norm_topk_prob=cfg.get("norm_topk_prob", True), scoring="sigmoid",
                     routed_scale=float(cfg.get("routed_scaling_factor", 1.0)))


def _config(*, vocab: int, hidden: int, heads: int, kv_heads: int,
            layer_types: tuple[str, ...], intermediate: int, context: int, eps: float,
            theta: float, kernel: int, tied: bool, name: str,
            experts: MoeConfig | None = None) -> ModelConfig:
    return ModelConfig(
        architecture="lfm2" if experts is None else "lfm2moe", vocab_size=vocab, hidden_size=hidden, num_layers=len(layer_types),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        intermediate_size=intermediate, max_position_embeddings=context, rms_norm_eps=eps,
        rope=RopeConfig(theta=theta), layer_types=layer_types, tie_word_embeddings=tied,
        qk_norm=True, name=name, moe=experts,
        recurrent=RecurrentConfig("short_conv", conv_kernel=kernel, conv_channels=hidden))


class Lfm2Model(HybridModel):
    """The hybrid decoder (kvlab.models.hybrid) with short convolutions and QK-norm attention."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, weights, layers, tp)
        self.inv_freq = RopeTable(rope_inv_freq(config.rope, config.head_dim).to(
            weights["norm"].device), config.max_position_embeddings)
        _check_conv_layers(config, layers)
        for layer in layers:  # LFM2-MoE without expert bias: the choice is by score alone
            if "router" in layer and "router_bias" not in layer:
                layer["router_bias"] = torch.zeros(layer["router"].shape[0])
        self.c_plan = decode_c.build_plan(config, layers, "silu")

    def recurrent(self, h: torch.Tensor, layer: dict[str, Any], state: LayerState,
                  states: StateBatch) -> torch.Tensor:
        """C * conv(B * x), each sequence from its own conv state."""
        b, gate, x = linear(h, layer["conv_in"], layer.get("conv_in_bias")).chunk(3, dim=-1)
        y = short_conv((b * x).contiguous(), layer["conv"], state.conv, states.slots,
                       states.lens, bias=layer.get("conv_bias"))
        return linear(gate * y, layer["conv_out"], layer.get("conv_out_bias"))

    def attention(self, h: torch.Tensor, layer: dict[str, Any],
                  rope: tuple[torch.Tensor, torch.Tensor], cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        q, k, v = split(linear(h, layer["qkv"]), layer["qkv"])
        q = norm_rope(q.reshape(-1, c.num_heads, c.head_dim), layer["q_norm"], *rope,
                      c.rms_norm_eps)
        k = norm_rope(k.reshape(-1, c.num_kv_heads, c.head_dim), layer["k_norm"], *rope,
                      c.rms_norm_eps)
        out = paged_attention(q, k, v.reshape(-1, c.num_kv_heads, c.head_dim), cache, meta,
                              sliding=False, scale=c.scale)
        return linear(out, layer["o"])


def _check_conv_layers(config: ModelConfig, layers: list[dict[str, Weight]]) -> None:
    """Each convolution layer has its tensors, the width and channels the config says."""
    rc = config.recurrent
    assert rc is not None
    for i, layer in enumerate(layers):
        if not config.is_recurrent(i):
            continue
        missing = [n for n in ("conv_in", "conv", "conv_out") if n not in layer]
        if missing:
            raise ModelLoadError(f"lfm2 layer {i} is a convolution layer but lacks "
                                 f"{', '.join(missing)}")
        shape = tuple(layer["conv"].shape)
        if shape != (rc.conv_channels, rc.conv_kernel):
            raise ModelLoadError(
                f"lfm2 layer {i}: the convolution weight is {list(shape)} but the config says "
                f"{rc.conv_channels} channels of width {rc.conv_kernel} (shortconv.l_cache)")


def _hf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """HF's depthwise conv weight [C, 1, K] -> [C, K], as llama.cpp stores it."""
    return t.squeeze(1) if name == "conv" and t.dim() == 3 else t


SPEC = ArchSpec(
    name="lfm2", model_cls=Lfm2Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_transform=_hf_transform, hf_architectures=("Lfm2ForCausalLM", "LFM2ForCausalLM"))
MOE_SPEC = dataclasses.replace(
    SPEC, name="lfm2moe", config_from_gguf=lambda meta: config_from_gguf(meta, "lfm2moe"),
    hf_architectures=("Lfm2MoeForCausalLM", "lfm2_moe"))
MULTIMODAL_SPEC = dataclasses.replace(
    SPEC, name="lfm2_multimodal",
    config_from_hf=lambda cfg: config_from_hf(multimodal_text_config(cfg)),
    hf_names=MULTIMODAL_HF_NAMES, hf_architectures=("Lfm2VlForConditionalGeneration",))
