"""gpt-oss (OpenAI's open-weight MoE; llama.cpp's `gpt-oss`): the Llama decoder with biases
on q, k, v and o, a learned sink logit per head in every attention softmax, sliding-window
(128) layers alternating with full ones, YaRN RoPE, and a mixture of experts routed by the
top k of a biased router's logits (softmax over those k) whose experts carry biases and run
a clamped SwiGLU: (clamp(up) + 1) * glu(clamp(gate)).

The shared pieces are options of the shared layers: sinks and the o bias of LlamaModel's
attention (kvlab/models/attention.py and the C kernels take the sinks), the routing, expert
biases and gate of kvlab/models/moe.py. What is gpt-oss's own is the checkpoint layout:

    HF    experts as x @ W: gate_up_proj [E, hidden, 2 * inter] with gate and up columns
          interleaved (gate at even ones), down_proj [E, inter, hidden]; biases likewise;
          or OpenAI's MXFP4 `_blocks` + `_scales` as [E, out, in] (kvlab.weights reads
          the pair as one MXFP4 tensor), gate and up rows interleaved
    GGUF  llama.cpp's converter splits gate and up and stores each expert as [out, in]

Both are brought to kvlab's [out, in] per expert with gate | up halves at load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.config import ModelConfig, hf_layer_types, interleaved_layer_types
from kvlab.errors import ModelLoadError
from kvlab.models import llama, moe
from kvlab.models.layers import Weight
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

ARCH = "gpt-oss"
SWIGLU = (1.702, 7.0)  # (alpha, limit): llama.cpp's fixed values, transformers' defaults
# llama.cpp's names and the Llama / MoE ones kvlab shares, plus gpt-oss's own
GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER,
           "post_attention_norm.weight": "mlp_norm",  # the norm before the experts
           "attn_output.bias": "o_bias", "attn_sinks.weight": "sinks",
           "ffn_gate_inp.bias": "router_bias", "ffn_gate_exps.bias": "gate_exps_bias",
           "ffn_up_exps.bias": "up_exps_bias", "ffn_down_exps.bias": "down_exps_bias"})
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer,
           "self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks",
           "mlp.router.weight": "router", "mlp.router.bias": "router_bias",
           "mlp.experts.gate_up_proj": "gate_up_exps", "mlp.experts.down_proj": "down_exps",
           "mlp.experts.gate_up_proj_bias": "gate_up_exps_bias",
           "mlp.experts.down_proj_bias": "down_exps_bias"})


def _moe_options(config: ModelConfig, swiglu: tuple[float, float]) -> ModelConfig:
    assert config.moe is not None
    return dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, scoring="topk_softmax", norm_topk_prob=False, swiglu_clamp=swiglu))


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """llama.cpp's keys; the layer pattern is `attention.sliding_window_pattern` (a flag per
    layer, or n: every n-th layer is full) where written, else llama.cpp's default for
    gpt-oss, 2: even layers slide. YaRN's ramp is not rounded to whole dimensions (gpt-oss's
    own rotary, transformers' truncate=false; the GGUF has no key for it)."""
    g = gguf_get(meta, ARCH)
    config = llama.config_from_gguf(meta, arch=ARCH)
    pattern = g("attention.sliding_window_pattern", 2)  # per layer, or every n-th is full
    types = (tuple("sliding" if s else "full" for s in pattern) if isinstance(pattern, list)
             else interleaved_layer_types(config.num_layers, int(pattern)))
    rope = config.rope
    if rope.yarn is not None:
        rope = dataclasses.replace(rope, yarn=dataclasses.replace(rope.yarn, truncate=False))
    config = dataclasses.replace(
        config, rope=rope, sliding_window=int(g("attention.sliding_window")),
        layer_types=types, moe=moe.moe_from_gguf(meta, ARCH, norm_topk_prob=False))
    return _moe_options(config, SWIGLU)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    config = llama.config_from_hf(cfg, arch=ARCH)
    n = config.num_layers
    types = cfg.get("layer_types")
    config = dataclasses.replace(
        config, sliding_window=cfg.get("sliding_window"),
        layer_types=hf_layer_types(types) if types else interleaved_layer_types(n, 2),
        moe=moe.moe_from_hf(cfg, inter_key="intermediate_size", norm_topk_prob=False))
    swiglu = (float(cfg.get("swiglu_alpha", SWIGLU[0])), float(cfg.get("swiglu_limit",
                                                                         SWIGLU[1])))
    return _moe_options(config, swiglu)


class GptOssModel(llama.LlamaModel):
    """The Llama decoder (its attention takes the layer's sinks and o bias) with gpt-oss's
    experts in every layer."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Any]], tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:  # the sinks and biases are not split across ranks
            raise ModelLoadError("gpt-oss runs on one rank (valid: tensor parallel size 1)")
        super().__init__(config, weights, [_expert_options(layer, config) for layer in layers],
                         tp)

    def mlp(self, h: torch.Tensor, layer: dict[str, Any],
            trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        assert self.config.moe is not None
        weights, ids = moe.route_topk_softmax(h, layer["router"], layer["router_bias"],
                                              self.config.moe.experts_per_token)
        if trace is not None:
            trace.append(ids)
        return moe.run_experts(h, layer["experts"], weights, ids)


def _expert_options(layer: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The layer with its experts' biases ([E, 2 * inter] gate | up, [E, hidden] down) and
    clamped SwiGLU in its moe.Experts."""
    assert config.moe is not None and config.moe.swiglu_clamp is not None
    out = dict(layer)
    if "gate_up_exps_bias" in out:
        gate_up = out.pop("gate_up_exps_bias")
    else:  # GGUF: gate and up apart
        gate_up = torch.cat([out.pop("gate_exps_bias"), out.pop("up_exps_bias")], dim=1)
    experts = out["experts"]
    out["experts"] = moe.Experts(experts.gate_up, experts.down, gate_up.float().contiguous(),
                                 out.pop("down_exps_bias").float().contiguous(),
                                 moe.ClampedSwiglu(*config.moe.swiglu_clamp))
    return out


def _halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate, up, gate, up ... along dim -> gate | up halves."""
    return torch.cat([t.index_select(dim, torch.arange(s, t.shape[dim], 2)) for s in (0, 1)],
                     dim=dim)


def _hf_transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """HF's experts (one expert's matrix at a time) -> [out, in], gate | up halves: float
    x @ W matrices ([hidden, 2 * inter] with interleaved columns, [inter, hidden]) are
    transposed; MXFP4 blocks (uint8 rows, the checkpoint's `_blocks` + `_scales`) are [out,
    in] already, gate and up rows interleaved."""
    blocks = t.dtype == torch.uint8
    if name == "gate_up_exps":
        return _halves(t if blocks else t.T, 0)
    if name == "down_exps":
        return t if blocks else t.T.contiguous()
    if name == "gate_up_exps_bias":  # [E, 2 * inter], interleaved
        return _halves(t, 1)
    return t


SPEC = ArchSpec(
    name=ARCH, model_cls=GptOssModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_transform=_hf_transform, hf_architectures=("GptOssForCausalLM", "gpt_oss"))
