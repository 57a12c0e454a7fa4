"""A dense model's decode layers through the Triton kernels of kvlab.gpu, on CUDA.

The GPU counterpart of decode_c: where the weights are on a CUDA device and triton is
importable, a pure decode step runs each layer as its four products and four fused kernels,
in place of the two dozen small torch kernels of the per-op path:

    qkv product -> qkv_rope_write (QK-norm, RoPE, K/V into their slots) -> paged decode
    attention -> o product -> residual_norm (x += h, mlp_norm) -> gate_up product -> gated
    (SwiGLU / GeGLU) -> down product -> residual_norm (x += h, next layer's attn_norm)

Post norms (Gemma's) fold into the residual kernels, the soft-cap (Gemma 2) and a dense
layer's sink logits into attention; MoE layers (gpt-oss's sinks among them) stay per-op. The kernels launch from shapes alone (no host sync), so a
captured decode graph (runner.decode_graph) records them as it records torch's. A step that
is not pure decode over float stores, or a layer the plan cannot take, returns to the
per-op path (run returns False having done nothing).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from kvlab.config import ModelConfig
from kvlab.kernels.packed import PackedWeight
from kvlab.models.attention import AttentionGroup, AttentionMetadata, KVStore
from kvlab.models.kv_store import FloatKV
from kvlab.models.layers import Stacked, Weight, linear

# triton's import alone takes seconds: only where there is a GPU for its kernels
if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    from kvlab.gpu import attention as gpu_attention
    from kvlab.gpu import fused as gpu_fused
else:
    gpu_attention = gpu_fused = None

_LAYER_KEYS = {"attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"}  # a plan needs all
_OPTIONAL = {"qkv_bias", "q_norm", "k_norm", "sinks", "o_bias", "post_attn_norm",
             "post_mlp_norm"}


@dataclass(frozen=True)
class Plan:
    gate: str  # the MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)


def build_plan(config: ModelConfig, layers: list[dict[str, Weight]], gate: str) -> Plan | None:
    """The plan for a model whose weights are on CUDA, when triton is importable."""
    if gpu_fused is None or not layers or not _on_cuda(layers[0]["attn_norm"]):
        return None
    return plan_for(config, layers, gate)


def plan_for(config: ModelConfig, layers: list[dict[str, Weight]], gate: str) -> Plan | None:
    """The plan on any device (the CPU under Triton's interpreter too), or None where a layer
    has something it does not run: a key outside its table (a router, shared KV), no norm
    before attention or MLP (OLMo 2), a whole-vector QK-norm, latent attention."""
    if config.qk_norm_whole or config.mla is not None or config.head_dim % 2:
        return None
    for layer in layers:
        keys = set(layer)
        if not _LAYER_KEYS <= keys or keys - _LAYER_KEYS - _OPTIONAL:
            return None
        if not isinstance(layer["qkv"], Stacked) or not isinstance(layer["gate_up"], Stacked):
            return None
    return Plan(gate)


def _on_cuda(w: object) -> bool:
    return isinstance(w, torch.Tensor) and w.is_cuda


def _input_dtype(w: Weight | Stacked) -> torch.dtype:
    """The dtype `linear` casts its input to: a dense or packed weight's own (bf16 on GPUs),
    fp32 for the CPU's block formats."""
    first = w.parts[0] if isinstance(w, Stacked) else w
    return first.dtype if isinstance(first, torch.Tensor | PackedWeight) else torch.float32


def run(plan: Plan, config: ModelConfig, x: torch.Tensor,
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]], kv_caches: list[KVStore],
        meta: AttentionMetadata, layers: list[dict[str, Weight]]) -> bool:
    """All layers on x [T, hidden] (the residual stream, updated in place); False, nothing
    done, when the step does not fit. ropes[config.second_rope(i)] is layer i's cos/sin."""
    groups = {s: _decode_group(meta.groups(s), x.shape[0]) for s in (False, True)}
    if None in groups.values() or not all(_float_store(c) for c in kv_caches):
        return False
    c, eps = config, config.rms_norm_eps
    h = gpu_fused.rms_norm(x, layers[0]["attn_norm"], eps, _input_dtype(layers[0]["qkv"]))
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        sliding = c.is_sliding(i)
        out = _attention(c, layer, h, ropes[c.second_rope(i)], cache, groups[sliding],
                         meta.write_slots(sliding))
        h = gpu_fused.residual_norm(x, out, layer.get("post_attn_norm"), layer["mlp_norm"],
                                    eps, _input_dtype(layer["gate_up"]))
        y = gpu_fused.gated(linear(h, layer["gate_up"]), plan.gate)
        last = i + 1 == len(layers)
        h = gpu_fused.residual_norm(
            x, linear(y, layer["down"]), layer.get("post_mlp_norm"),
            None if last else layers[i + 1]["attn_norm"], eps,
            None if last else _input_dtype(layers[i + 1]["qkv"]))
    return True


def _attention(c: ModelConfig, layer: dict[str, Weight], h: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], cache: FloatKV, g: AttentionGroup,
               write_slots: torch.Tensor) -> torch.Tensor:
    """[T, hidden] normed input -> the o product's output [T, hidden]."""
    qkv = linear(h, layer["qkv"], layer.get("qkv_bias"))
    q = gpu_fused.qkv_rope_write(qkv, c.num_heads, c.num_kv_heads, c.head_dim,
                                 layer.get("q_norm"), layer.get("k_norm"), *rope,
                                 c.rms_norm_eps, write_slots, cache.k, cache.v)
    out = gpu_attention.paged_decode_attention(
        q, cache.k, cache.v, g.slots, c.scale, lengths=g.lengths,
        mask=None if g.lengths is not None else g.mask,
        softcap=c.attn_logit_softcapping or 0.0, sinks=layer.get("sinks"))
    return linear(out.reshape(h.shape[0], -1), layer["o"], layer.get("o_bias"))


def _decode_group(groups: tuple[AttentionGroup, ...], tokens: int) -> AttentionGroup | None:
    """The step's one decode group over all T rows (rows ascend, so they are 0..T-1), with
    the keys each row sees given by its lengths or its mask; None for anything else."""
    if len(groups) != 1:
        return None
    g = groups[0]
    whole = g.rows.numel() == tokens and g.queries_per_seq == 1 and not g.prefill
    return g if whole and (g.lengths is not None or g.mask is not None) else None


def _float_store(cache: KVStore | None) -> bool:
    return isinstance(cache, FloatKV) and cache.k.is_contiguous() and cache.v.is_contiguous()
