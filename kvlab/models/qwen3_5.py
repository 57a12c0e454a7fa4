"""Qwen3.5 (dense and MoE): Gated DeltaNet layers (three of every four) beside gated
attention layers; SwiGLU MLPs, or (Qwen3.5-MoE) kvlab.models.moe's experts with a shared
expert gated by sigmoid(shexp_router . h).

A Gated DeltaNet layer (linear attention with a delta-rule state per value head):

    h -> qkv | z | b | a                       one product
    qkv -> causal conv (width K) + SiLU        its state: the last K - 1 inputs
    q, k L2-normalised; beta = sigmoid(b); g = A * softplus(a + dt_bias)   (A = -exp(A_log))
    S = exp(g) S + k (beta (v - k^T S))^T;  o = (q / sqrt(Dk))^T S          state S [Dk, Dv]
    o -> RMSNorm per head * silu(z) -> out_proj

so a sequence's state is the conv's inputs [K - 1, C] and S [Hv, Dk, Dv] per layer
(kvlab.models.state_store). Value head h reads key head h // (Hv / Hk). The attention layers
carry an output gate (q_proj gives each head's query then its gate: out * sigmoid(gate)),
QK-norm, and rotate the first `partial_rotary_factor` of each head's dimensions (Qwen3.5's
multimodal rope is plain rope on text positions). Norms multiply by 1 + w (held as 1 + w;
GGUF stores it so), except the DeltaNet output norm.

GGUF (llama.cpp's qwen35 / qwen35moe): recurrent layers from `attention.recurrent_layers`;
A stored as -exp(A_log); where Hv > Hk the converter reorders value heads from grouped by
key head [k0: v0 v1, k1: v0 v1] to tiled [k0v0, k1v0, k0v1, k1v1] (every weight and state
along the value heads alike), so value head j reads key head j % Hk (v_heads_tiled): the key
heads are repeated in that order, and quantized weights stay as stored.
The multimodal checkpoints (Qwen3_5ForConditionalGeneration) load their text model alone.

The multi-token-prediction layer (--speculative mtp, kvlab.models.mtp) is one gated attention
layer with the model's MLP or experts: HF `mtp.*` (MTP_HF_NAMES, in both the text-only and
the multimodal checkpoints), GGUF `blk.{N}.nextn.*` beside layer N's ordinary names (llama.cpp's
converter keeps it unless told --no-mtp). Its norms are 1 + w too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.config import ModelConfig, RecurrentConfig, RopeConfig, hf_layer_types
from kvlab.errors import ModelLoadError
from kvlab.kernels.recurrent import gated_delta_rule, gated_rms_norm, short_conv
from kvlab.models import decode_c, llama, moe
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.hybrid import HybridModel, check_state_tensors
from kvlab.models.layers import (
    RopeTable,
    Stacked,
    Weight,
    apply_rope,
    linear,
    rms_norm,
    rope_inv_freq,
    split,
)
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, multimodal_text_config
from kvlab.models.state_store import LayerState, StateBatch

_DELTA_GGUF = {"attn_qkv.weight": "delta_qkv", "attn_gate.weight": "delta_z",
               "ssm_beta.weight": "delta_b", "ssm_alpha.weight": "delta_a", "ssm_a": "ssm_a",
               "ssm_dt.bias": "dt_bias", "ssm_conv1d.weight": "conv",
               "ssm_norm.weight": "delta_norm", "ssm_out.weight": "delta_out"}
GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, "post_attention_norm.weight": "mlp_norm", **_DELTA_GGUF,
           **moe.GGUF_LAYER})
_HF_LAYER = {
    **llama.HF_NAMES.layer,
    "linear_attn.in_proj_qkv.weight": "delta_qkv", "linear_attn.in_proj_z.weight": "delta_z",
    "linear_attn.in_proj_b.weight": "delta_b", "linear_attn.in_proj_a.weight": "delta_a",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "dt_bias",
    "linear_attn.conv1d.weight": "conv", "linear_attn.norm.weight": "delta_norm",
    "linear_attn.out_proj.weight": "delta_out", **moe.HF_LAYER,
    "mlp.shared_expert_gate.weight": "shexp_router",
    "mlp.shared_expert.gate_proj.weight": "shexp_gate",
    "mlp.shared_expert.up_proj.weight": "shexp_up",
    "mlp.shared_expert.down_proj.weight": "shexp_down"}
HF_NAMES = NameTable(globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
                     layer=_HF_LAYER, experts=moe.HF_EXPERTS)
# Qwen3_5ForConditionalGeneration: the text model under model.language_model
MULTIMODAL_HF_NAMES = NameTable(
    globals={"model.language_model.embed_tokens.weight": "embed",
             "model.language_model.norm.weight": "norm", "lm_head.weight": "lm_head"},
    layer_prefix="model.language_model.layers.{i}.", layer=_HF_LAYER, experts=moe.HF_EXPERTS)
# the MTP layer apart from the main ones: fc, its two input norms and its final norm beside
# one decoder layer named as the main layers' are
MTP_HF_NAMES = NameTable(
    globals={}, layer_prefix="mtp.",
    layer={"fc.weight": "eh_proj", "pre_fc_norm_embedding.weight": "enorm",
           "pre_fc_norm_hidden.weight": "hnorm", "norm.weight": "head_norm",
           **{f"layers.0.{src}": dst for src, dst in _HF_LAYER.items()}},
    experts={f"layers.0.{src}": dst for src, dst in moe.HF_EXPERTS.items()})
# 1 + w (not delta_norm); enorm, hnorm, head_norm: the MTP layer's
NORMS = {"norm", "attn_norm", "mlp_norm", "q_norm", "k_norm", "enorm", "hnorm", "head_norm"}


def _config(arch: str, *, vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
            layer_types: tuple[str, ...], intermediate: int, context: int, eps: float,
            theta: float, rotary_dim: int, delta: RecurrentConfig, tied: bool,
            name: str, experts: moe.MoeConfig | None) -> ModelConfig:
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=len(layer_types),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, max_position_embeddings=context, rms_norm_eps=eps,
        rope=RopeConfig(theta=theta, partial=rotary_dim / head_dim), layer_types=layer_types,
        tie_word_embeddings=tied, qk_norm=True, name=name, recurrent=delta, moe=experts)


def _delta(kernel: int, hk: int, hv: int, dk: int, dv: int,
           tiled: bool = False) -> RecurrentConfig:
    return RecurrentConfig("gated_delta", conv_kernel=kernel, conv_channels=2 * hk * dk + hv * dv,
                           num_k_heads=hk, num_v_heads=hv, k_head_dim=dk, v_head_dim=dv,
                           v_heads_tiled=tiled)


def config_from_gguf(meta: dict[str, Any], arch: str = "qwen35") -> ModelConfig:
    g = gguf_get(meta, arch)
    # block_count counts the multi-token-prediction (nextn) layers at the end: not run
    blocks, heads = int(g("block_count")), int(g("attention.head_count"))
    layers = blocks - int(g("nextn_predict_layers", 0))
    every = int(g("full_attention_interval", 4))  # files without the per-layer list
    recurrent = [bool(r) for r in g("attention.recurrent_layers", None)
                 or [(i + 1) % every != 0 for i in range(blocks)]]
    if len(recurrent) != blocks:
        raise ModelLoadError(f"{arch}.attention.recurrent_layers has {len(recurrent)} entries "
                             f"for {blocks} layers (block_count)")
    recurrent = recurrent[:layers]
    hv, inner = int(g("ssm.time_step_rank")), int(g("ssm.inner_size"))
    if inner % hv:
        raise ModelLoadError(f"{arch}.ssm.inner_size {inner} is not a multiple of "
                             f"ssm.time_step_rank {hv} (value heads)")
    head_dim = int(g("attention.key_length"))
    vocab = g("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    experts = (moe.moe_from_gguf(meta, arch, norm_topk_prob=True)
               if f"{arch}.expert_count" in meta else None)
    return _config(
        arch, vocab=int(vocab), hidden=int(g("embedding_length")), heads=heads,
        kv_heads=int(g("attention.head_count_kv")), head_dim=head_dim,
        layer_types=tuple("recurrent" if r else "full" for r in recurrent),
        intermediate=int(g("feed_forward_length", 0)), context=int(g("context_length")),
        eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        theta=float(g("rope.freq_base", 1e7)),
        rotary_dim=int(g("rope.dimension_count", head_dim)),
        delta=_delta(int(g("ssm.conv_kernel")), int(g("ssm.group_count")), hv,
                     int(g("ssm.state_size")), inner // hv, tiled=True),
        tied=True,  # refined by the loader: untied where output.weight exists
        name=str(meta.get("general.name", arch)), experts=experts)


def config_from_hf(cfg: dict[str, Any], arch: str = "qwen35") -> ModelConfig:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    experts = moe.moe_from_hf(cfg, norm_topk_prob=True) if cfg.get("num_experts") else None
    return _config(
        arch, vocab=cfg["vocab_size"], hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
        head_dim=head_dim, layer_types=hf_layer_types(types),
        intermediate=cfg.get("intermediate_size") or 0,
        context=cfg.get("max_position_embeddings", 32768), eps=cfg.get("rms_norm_eps", 1e-6),
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 1e7))),
        rotary_dim=int(head_dim * partial),
        delta=_delta(cfg["linear_conv_kernel_dim"], cfg["linear_num_key_heads"],
                     cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                     cfg["linear_value_head_dim"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        name=cfg.get("_name_or_path", arch), experts=experts)


def config_from_multimodal_hf(cfg: dict[str, Any], arch: str = "qwen35") -> ModelConfig:
    """The text model of Qwen3_5(Moe)ForConditionalGeneration; the vision tower is not loaded."""
    return config_from_hf(multimodal_text_config(cfg), arch)


class Qwen35Model(HybridModel):
    """The hybrid decoder (kvlab.models.hybrid) with Gated DeltaNet layers, gated attention
    and, in Qwen3.5-MoE, mixture-of-experts MLPs."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, weights, [_delta_layer(config, i, layer)
                                           if config.is_recurrent(i) else layer
                                           for i, layer in enumerate(layers)], tp)
        rotary = round(config.head_dim * config.rope.partial)  # rope_cos_sin: [T, 1, rotary]
        self.inv_freq = RopeTable(rope_inv_freq(RopeConfig(theta=config.rope.theta), rotary).to(
            weights["norm"].device), config.max_position_embeddings)
        self.c_plan = decode_c.build_plan(config, self.layers, "silu", output_gate=True)

    def recurrent(self, h: torch.Tensor, layer: dict[str, Any], state: LayerState,
                  states: StateBatch) -> torch.Tensor:
        """One Gated DeltaNet layer (module docstring)."""
        rc = self.config.recurrent
        assert rc is not None and state.recurrent is not None
        qkv, z, b, a = split(linear(h, layer["delta_in"]), layer["delta_in"])
        qkv = short_conv(qkv.contiguous(), layer["conv"], state.conv, states.slots,
                         states.lens, activation="silu")
        q, k, v = qkv.split([rc.num_k_heads * rc.k_head_dim] * 2 + [rc.num_v_heads * rc.v_head_dim],
                            dim=-1)
        q, k = (_l2norm(t.reshape(-1, rc.num_k_heads, rc.k_head_dim)) for t in (q, k))
        if rc.v_heads_tiled:  # value head j reads key head j % Hk: repeat the key heads
            r = rc.num_v_heads // rc.num_k_heads
            q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)
        g = layer["ssm_a"] * F.softplus(a.float() + layer["dt_bias"])
        o = gated_delta_rule(q, k, v.reshape(-1, rc.num_v_heads, rc.v_head_dim), g,
                             torch.sigmoid(b.float()), state.recurrent, states.slots,
                             states.lens, scale=rc.k_head_dim ** -0.5)
        o = gated_rms_norm(o, z.reshape(o.shape), layer["delta_norm"], self.config.rms_norm_eps,
                           group_size=rc.v_head_dim, norm_before_gate=True)
        return linear(o.reshape(o.shape[0], -1), layer["delta_out"])

    def attention(self, h: torch.Tensor, layer: dict[str, Any],
                  rope: tuple[torch.Tensor, torch.Tensor], cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Gated attention: each head's query and output gate from q_proj, QK-norm, RoPE on
        the first rotary dims, out * sigmoid(gate)."""
        c = self.config
        q_gate, k, v = split(linear(h, layer["qkv"]), layer["qkv"])
        q, gate = q_gate.reshape(-1, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        q = _partial_rope(rms_norm(q.contiguous(), layer["q_norm"], c.rms_norm_eps), *rope)
        k = _partial_rope(rms_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), layer["k_norm"],
                                   c.rms_norm_eps), *rope)
        out = paged_attention(q, k, v.reshape(-1, c.num_kv_heads, c.head_dim), cache, meta,
                              sliding=False, scale=c.scale)
        return linear(out * torch.sigmoid(gate.reshape(out.shape)), layer["o"])


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (transformers' and FLA's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x's first cos.shape[-1] dims (rotate-half within them); the rest unchanged."""
    rotary = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


def _delta_layer(config: ModelConfig, i: int, layer: dict[str, Weight]) -> dict[str, Any]:
    """A DeltaNet layer's four input products stacked as one (delta_in), its shapes checked
    against the config (a GGUF whose ssm.* keys disagree with its tensors fails here)."""
    rc = config.recurrent
    assert rc is not None
    parts = ("delta_qkv", "delta_z", "delta_b", "delta_a")
    hv, dv = rc.num_v_heads, rc.v_head_dim
    expect = {"delta_qkv": (rc.conv_channels, config.hidden_size),
              "delta_z": (hv * dv, config.hidden_size), "delta_b": (hv, config.hidden_size),
              "delta_a": (hv, config.hidden_size), "conv": (rc.conv_channels, rc.conv_kernel),
              "ssm_a": (hv,), "dt_bias": (hv,), "delta_norm": (dv,),
              "delta_out": (config.hidden_size, hv * dv)}
    check_state_tensors(config, i, layer, expect, "DeltaNet",
                        f"conv kernel {rc.conv_kernel}, key heads {rc.num_k_heads} x "
                        f"{rc.k_head_dim}, value heads {hv} x {dv}")
    rest = {n: w for n, w in layer.items() if n not in parts}
    return {**rest, "delta_in": Stacked.of([layer[n] for n in parts])}


def _gguf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    # llama.cpp may store the shared expert's gate as a vector [hidden]: one output row
    return t.reshape(1, -1) if name == "shexp_router" else t


def _hf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if name in NORMS:
        return t.float() + 1.0
    if name == "ssm_a":
        return -t.float().exp()
    if name == "conv" and t.dim() == 3:  # [C, 1, K] -> [C, K], as llama.cpp stores it
        return t.squeeze(1)
    return t


SPEC = ArchSpec(
    name="qwen35", model_cls=Qwen35Model, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_gguf_transform, hf_transform=_hf_transform,
    hf_architectures=("Qwen3_5ForCausalLM", "qwen3_5_text"), hf_mtp_names=MTP_HF_NAMES)
MOE_SPEC = dataclasses.replace(
    SPEC, name="qwen35moe",
    config_from_gguf=lambda meta: config_from_gguf(meta, "qwen35moe"),
    config_from_hf=lambda cfg: config_from_hf(cfg, "qwen35moe"),
    hf_architectures=("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"))
MULTIMODAL_SPEC = dataclasses.replace(
    SPEC, name="qwen35_multimodal", config_from_hf=config_from_multimodal_hf,
    hf_names=MULTIMODAL_HF_NAMES, hf_architectures=("Qwen3_5ForConditionalGeneration",))
MOE_MULTIMODAL_SPEC = dataclasses.replace(
    MOE_SPEC, name="qwen35moe_multimodal",
    config_from_hf=lambda cfg: config_from_multimodal_hf(cfg, "qwen35moe"),
    hf_names=MULTIMODAL_HF_NAMES, hf_architectures=("Qwen3_5MoeForConditionalGeneration",))
