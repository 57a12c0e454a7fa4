"""Granite 4 hybrid (GraniteMoeHybrid; llama.cpp's `granitehybrid`): Mamba-2 layers beside
attention layers, each followed by a SwiGLU MLP (the "shared" MLP) plus, in the MoE
variants, routed experts (softmax over the top k of the router's logits):

    x = embed(ids) * embedding_multiplier
    x += residual_multiplier * (mamba2(norm(x), state) or attention(norm(x), kv))
    x += residual_multiplier * (shared_mlp(norm(x)) + experts(norm(x)))
    logits = lm_head(norm(x)) / logits_scaling

The Mamba-2 mixer is kvlab.models.mamba2_layer's, its conv and SSM states [H, P, N] a
recurrent kind of the state slots ("mamba2"). Attention scores are scaled by
attention_multiplier, not head_dim ** -0.5; the "nope" checkpoints (position_embedding_type
not "rope"; in GGUF rope.scaling.finetuned false) rotate nothing. Which layers are Mamba:
HF's `layer_types` ("mamba" / "attention", or transformers' "linear_attention" /
"full_attention"); in GGUF, the layers whose `attention.head_count_kv` entry is 0.
Decode steps run all layers in one C call (kvlab.models.decode_c) where every product has
a C kernel: plan_layers names the layers as the plan reads them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlab.config import ModelConfig, MoeConfig, RecurrentConfig, RopeConfig
from kvlab.errors import ModelLoadError
from kvlab.models import decode_c, llama, moe
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.hybrid import HybridModel, check_state_tensors
from kvlab.models.layers import RopeTable, Weight, apply_rope, linear, rope_inv_freq, split
from kvlab.models.mamba2_layer import Mamba2Shape, mamba2_mixer
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, hf_rope
from kvlab.models.state_store import LayerState, StateBatch

# llama.cpp's Mamba-2 tensors (A stored as -exp(A_log), A and D as [H, 1], the norm [G, d/G])
MAMBA2_GGUF = {"ssm_in.weight": "in_proj", "ssm_conv1d.weight": "conv",
               "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias", "ssm_a": "ssm_a",
               "ssm_d": "D", "ssm_norm.weight": "norm", "ssm_out.weight": "out_proj"}
GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, **MAMBA2_GGUF, "ffn_gate_inp.weight": "router",
           "ffn_gate_exps.weight": "gate_exps", "ffn_up_exps.weight": "up_exps",
           "ffn_down_exps.weight": "down_exps",
           # the shared MLP: ffn_gate/up/down in dense files, *_shexp beside experts
           "ffn_gate_shexp.weight": "gate", "ffn_up_shexp.weight": "up",
           "ffn_down_shexp.weight": "down"})
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer,
           **{f"mamba.{n}": d for n, d in (
               ("in_proj.weight", "in_proj"), ("in_proj.bias", "in_proj_bias"),
               ("conv1d.weight", "conv"), ("conv1d.bias", "conv_bias"),
               ("dt_bias", "dt_bias"), ("A_log", "ssm_a"), ("D", "D"),
               ("norm.weight", "norm"), ("out_proj.weight", "out_proj"),
               ("out_proj.bias", "out_proj_bias"))},
           "shared_mlp.input_linear.weight": "gate_up", "shared_mlp.output_linear.weight": "down",
           "block_sparse_moe.router.layer.weight": "router",
           "block_sparse_moe.input_linear.weight": "gate_up_exps",
           "block_sparse_moe.output_linear.weight": "down_exps"})


def mamba2_config(*, kernel: int, heads: int, head_dim: int, groups: int, state: int,
                  limit: tuple[float, float] = (0.0, math.inf)) -> RecurrentConfig:
    """The "mamba2" recurrent kind: conv over x, B and C; SSM state [H, P, N]."""
    return RecurrentConfig("mamba2", conv_kernel=kernel,
                           conv_channels=heads * head_dim + 2 * groups * state,
                           ssm_heads=heads, ssm_head_dim=head_dim, ssm_groups=groups,
                           ssm_state_size=state, time_step_limit=limit)


def mamba2_shape(config: ModelConfig) -> Mamba2Shape:
    rc = config.recurrent
    assert rc is not None and rc.kind == "mamba2"
    return Mamba2Shape(heads=rc.ssm_heads, head_dim=rc.ssm_head_dim, groups=rc.ssm_groups,
                       state_size=rc.ssm_state_size, conv_kernel=rc.conv_kernel,
                       eps=config.rms_norm_eps, time_step_limit=rc.time_step_limit)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "granitehybrid")
    layers, heads = int(g("block_count")), int(g("attention.head_count"))
    kv = g("attention.head_count_kv")
    kv_heads = [int(n) for n in kv] if isinstance(kv, list | tuple) else [int(kv)] * layers
    if len(kv_heads) != layers:
        raise ModelLoadError(f"granitehybrid.attention.head_count_kv {kv!r}: need one entry "
                             f"per layer ({layers}), 0 for a Mamba-2 layer")
    ssm_heads, inner = int(g("ssm.time_step_rank")), int(g("ssm.inner_size"))
    if inner % ssm_heads:
        raise ModelLoadError(f"granitehybrid.ssm.inner_size {inner} is not a multiple of "
                             f"ssm.time_step_rank {ssm_heads} (SSM heads)")
    hidden = int(g("embedding_length"))
    experts = (moe.moe_from_gguf(meta, "granitehybrid", norm_topk_prob=True)
               if int(g("expert_count", 0)) else None)
    shared = int(g("expert_shared_feed_forward_length", 0)) or int(g("feed_forward_length"))
    vocab = g("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    rope = bool(g("rope.scaling.finetuned", True))
    return ModelConfig(
        architecture="granitehybrid", vocab_size=int(vocab), hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=max(kv_heads) or heads,
        head_dim=int(g("attention.key_length", hidden // heads)), intermediate_size=shared,
        max_position_embeddings=int(g("context_length")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=RopeConfig(theta=float(g("rope.freq_base", 10000.0))),
        layer_types=tuple("recurrent" if n == 0 else "full" for n in kv_heads),
        tie_word_embeddings=True, attn_scale=g("attention.scale", None),
        moe=experts, name=str(meta.get("general.name", "granitehybrid")),
        no_rope_layers=() if rope else (True,) * layers,
        recurrent=mamba2_config(kernel=int(g("ssm.conv_kernel")), heads=ssm_heads,
                                head_dim=inner // ssm_heads, groups=int(g("ssm.group_count")),
                                state=int(g("ssm.state_size"))),
        embedding_scale=float(g("embedding_scale", 1.0)),
        residual_scale=float(g("residual_scale", 1.0)), logit_scale=float(g("logit_scale", 1.0)))


def json_float(v: Any) -> float:
    """A float as transformers writes it to JSON ({"__float__": "Infinity"} for inf)."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    ssm_heads = cfg["mamba_n_heads"]
    head_dim = cfg.get("mamba_d_head")
    if not isinstance(head_dim, int):  # "auto"
        head_dim = cfg.get("mamba_expand", 2) * hidden // ssm_heads
    limit = tuple(map(json_float, cfg.get("time_step_limit") or (0.0, math.inf)))
    rope = cfg.get("position_embedding_type") == "rope"
    experts = (MoeConfig(num_experts=cfg["num_local_experts"],
                             experts_per_token=cfg["num_experts_per_tok"],
                             expert_intermediate_size=cfg["intermediate_size"],
                             norm_topk_prob=True)
               if cfg.get("num_local_experts") else None)
    return ModelConfig(
        architecture="granitehybrid", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=hidden // heads,
        intermediate_size=cfg.get("shared_intermediate_size") or cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope=hf_rope(cfg) if rope else RopeConfig(),
        layer_types=tuple("recurrent" if t in ("mamba", "linear_attention") else "full"
                          for t in types),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_scale=cfg.get("attention_multiplier"), moe=experts,
        name=cfg.get("_name_or_path", "granitehybrid"),
        no_rope_layers=() if rope else (True,) * layers,
        recurrent=mamba2_config(kernel=cfg.get("mamba_d_conv", 4), heads=ssm_heads,
                                head_dim=head_dim, groups=cfg.get("mamba_n_groups", 1),
                                state=cfg.get("mamba_d_state", 128), limit=limit),
        embedding_scale=float(cfg.get("embedding_multiplier", 1.0)),
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),
        logit_scale=float(cfg.get("logits_scaling", 1.0)))


class GraniteHybridModel(HybridModel):
    """The hybrid decoder (kvlab.models.hybrid) with Mamba-2 mixers, attention with or
    without RoPE, and the shared MLP plus (MoE variants) routed experts."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Any]], tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, weights, layers, tp)
        self.shape = mamba2_shape(config)
        check_mamba2_layers(config, layers, self.shape)
        self.inv_freq = RopeTable(rope_inv_freq(config.rope, config.head_dim).to(
            weights["norm"].device), config.max_position_embeddings)
        self.c_plan = decode_c.build_plan(config, self.plan_layers(), self.plan_gate)

    plan_gate = "silu"  # the C plan's MLP activation (decode_c.GATES)

    def plan_layers(self) -> list[dict[str, Any]]:
        """The layers as the C plan names them: beside routed experts, the shared MLP is the
        ungated shared expert (added to their sum as mlp does)."""
        return [layer if "router" not in layer else
                {**{n: w for n, w in layer.items() if n not in ("gate_up", "down")},
                 "shexp_gate_up": layer["gate_up"], "shexp_down": layer["down"]}
                for layer in self.layers]

    def recurrent(self, h: torch.Tensor, layer: dict[str, Any], state: LayerState,
                  states: StateBatch) -> torch.Tensor:
        assert state.recurrent is not None
        return mamba2_mixer(h, layer, self.shape, state.conv, state.recurrent, states.slots,
                            states.lens)

    def attention(self, h: torch.Tensor, layer: dict[str, Any],
                  rope: tuple[torch.Tensor, torch.Tensor], cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        q, k, v = split(linear(h, layer["qkv"]), layer["qkv"])
        q, k = q.reshape(-1, c.num_heads, c.head_dim), k.reshape(-1, c.num_kv_heads, c.head_dim)
        if not c.no_rope(0):
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = paged_attention(q, k, v.reshape(-1, c.num_kv_heads, c.head_dim), cache, meta,
                              sliding=False, scale=c.scale)
        return linear(out, layer["o"])

    def mlp(self, h: torch.Tensor, layer: dict[str, Any],
            trace: list[torch.Tensor] | None) -> torch.Tensor:
        """The routed experts (where the layer has a router) plus the shared SwiGLU MLP."""
        shared = self.swiglu_mlp(h, layer)
        return shared if "router" not in layer else super().mlp(h, layer, trace) + shared


def check_mamba2_layers(config: ModelConfig, layers: list[dict[str, Any]],
                        s: Mamba2Shape) -> None:
    """Each Mamba-2 layer has its tensors in the shapes the config's SSM dimensions give (a
    GGUF whose ssm.* keys disagree with its tensors fails here)."""
    hidden = config.hidden_size
    expect = {"in_proj": (s.d_inner + s.conv_channels + s.heads, hidden),
              "conv": (s.conv_channels, s.conv_kernel), "dt_bias": (s.heads,),
              "ssm_a": (s.heads,), "D": (s.heads,), "norm": (s.d_inner,),
              "out_proj": (hidden, s.d_inner)}
    dims = (f"conv kernel {s.conv_kernel}, {s.heads} heads x {s.head_dim}, {s.groups} groups "
            f"of state {s.state_size}")
    for i, layer in enumerate(layers):
        if config.is_recurrent(i):
            check_state_tensors(config, i, layer, expect, "Mamba-2", dims)


def mamba2_gguf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """llama.cpp's A and D [H, 1] and norm [G, d/G] as flat vectors."""
    return t.reshape(-1) if name in ("ssm_a", "D", "norm") else t


def mamba2_hf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """A = -exp(A_log) (as llama.cpp stores it); the depthwise conv [C, 1, K] -> [C, K]."""
    if name == "ssm_a":
        return -t.float().exp()
    return t.squeeze(1) if name == "conv" and t.dim() == 3 else t


def _gguf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """q and k back from llama.cpp's rope row order, then the Mamba-2 reshapes."""
    if name in ("q", "k"):
        return llama.unpermute_qk(t, config.num_heads if name == "q" else config.num_kv_heads)
    return mamba2_gguf_transform(config, name, t)


SPEC = ArchSpec(
    name="granitehybrid", model_cls=GraniteHybridModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_gguf_transform, hf_transform=mamba2_hf_transform,
    hf_architectures=("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    fused_sizes=lambda c: {"gate_up": (c.intermediate_size, c.intermediate_size)})
