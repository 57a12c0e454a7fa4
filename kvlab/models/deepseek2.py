"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; llama.cpp's `deepseek2`;
also Kimi K2 and GLM-4.7-Flash, which share the layout): multi-head latent attention and a
mixture of experts after `first_k_dense_replace` dense layers.

Latent attention: each token's keys and values come from one latent c (kv_lora_rank values,
kv_a's first rows after kv_a_norm) and a rotary key part k_r (qk_rope_head_dim values, one
for all heads). Head h's key is [W_UK_h c | k_r] and its value W_UV_h c, where kv_b stacks
W_UK_h [qk_nope, rank] and W_UV_h [v_head_dim, rank] per head (llama.cpp's GGUF stores them
apart: attn_k_b transposed, attn_v_b). The cache keeps only [c | k_r] per token
(kv_store.LatentKV), and attention runs on it with the projections absorbed:

    score_h = q_nope_h . W_UK_h c + q_r_h . k_r = [W_UK_h^T q_nope_h | q_r_h] . [c | k_r]
    out_h   = sum_j p_j W_UV_h c_j = W_UV_h (sum_j p_j c_j)

so every head is a query of width rank + rope over one shared key row, the values are the
keys' first `rank` columns, and W_UV_h maps each head's result back to v_head_dim: the same
numbers as attention over the expanded per-head K/V (transformers' form), from a cache
2 * heads * head_dim / (rank + rope) times smaller. On the CPU the absorbed attention, W_UK
and W_UV included, is one C call per layer (fused.mla_decode / mla_prefill), and decode runs
every layer in the one C call (decode_c's latent-attention fields); elsewhere (GPUs) W_UK
and W_UV are torch products around paged_attention.

Rotary dims are stored in pair order (x0, x1 rotate together: transformers' rope_interleave,
llama.cpp's NORM rope); both loaders lay them out as halves for kvlab's rotate-half RoPE.
DeepSeek-V3 routes by sigmoid with a choice bias and grouped top-k (moe.route_sigmoid), V2
by softmax, its top k limited to the best groups in V2 and V2.5 (moe.route); all scale the chosen weights by routed_scaling_factor and add shared experts.
The softmax scale is qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim) squared.
Multi-token-prediction (nextn) layers after num_hidden_layers are left out of the main
model; --speculative mtp runs the first as its proposer (kvlab.models.mtp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.config import MlaConfig, ModelConfig, MoeConfig, RopeConfig, Yarn, yarn_mscale
from kvlab.errors import ModelLoadError
from kvlab.kernels import QuantizedWeight, dequantize, fused
from kvlab.models import decode_c, glm4moe, llama, moe
from kvlab.models.attention import AttentionMetadata, KVStore, paged_attention
from kvlab.models.kv_store import LatentKV
from kvlab.models.layers import (
    RopeTable,
    ScaledRope,
    Weight,
    apply_rope,
    linear,
    rms_norm,
    rope_inv_freq,
)
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get, hf_rope

_ATTN_GGUF = {"attn_q_a.weight": "q_a", "attn_q_a_norm.weight": "q_a_norm",
              "attn_q_b.weight": "q_b", "attn_kv_a_mqa.weight": "kv_a",
              "attn_kv_a_norm.weight": "kv_a_norm", "attn_kv_b.weight": "kv_b",
              "attn_k_b.weight": "k_b", "attn_v_b.weight": "v_b"}
GGUF_NAMES = NameTable(
    globals=llama.GGUF_NAMES.globals, layer_prefix="blk.{i}.",
    layer={**llama.GGUF_NAMES.layer, **moe.GGUF_LAYER, **_ATTN_GGUF,
           "exp_probs_b.bias": "router_bias"})
_ATTN_HF = {f"self_attn.{src}.weight": dst for src, dst in (
    ("q_a_proj", "q_a"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "q_b"),
    ("kv_a_proj_with_mqa", "kv_a"), ("kv_a_layernorm", "kv_a_norm"), ("kv_b_proj", "kv_b"))}
HF_NAMES = NameTable(
    globals=llama.HF_NAMES.globals, layer_prefix="model.layers.{i}.",
    layer={**llama.HF_NAMES.layer, **moe.HF_LAYER, **_ATTN_HF,
           "mlp.gate.e_score_correction_bias": "router_bias",
           **moe.hf_shared_expert("mlp.shared_experts")},
    experts=moe.HF_EXPERTS)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    mla = MlaConfig(int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
                    int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]),
                    cfg.get("q_lora_rank") and int(cfg["q_lora_rank"]))
    rope = hf_rope(cfg)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    mscale = (yarn_mscale(rope.yarn.factor, float(scaling["mscale_all_dim"]))
              if rope.yarn is not None and scaling.get("mscale_all_dim") else 1.0)
    base = llama.config_from_hf({**cfg, "num_key_value_heads": 1, "head_dim": 1},
                                arch="deepseek2")
    return _mla_config(base, mla, rope, mscale, _hf_moe(cfg))


def _hf_moe(cfg: dict[str, Any]) -> MoeConfig | None:
    """DeepSeek-V3's sigmoid routing (GLM-4.5's keys), or V2's softmax over all experts (no
    renormalisation unless norm_topk_prob), its top k over all of them (topk_method greedy)
    or within the topk_group of n_group groups whose best score is highest
    (group_limited_greedy: V2 and V2.5)."""
    if not cfg.get("n_routed_experts"):
        return None
    v2 = cfg.get("model_type") == "deepseek_v2"  # softmax routing; V3 and later: sigmoid
    if cfg.get("scoring_func", "softmax" if v2 else "sigmoid") == "sigmoid":
        return glm4moe.hf_sigmoid_moe(cfg)
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"DeepSeek-V2 topk_method {method!r} is not supported (valid: "
                             "greedy, group_limited_greedy, or noaux_tc with sigmoid scoring)")
    groups = int(cfg.get("n_group") or 1) if method == "group_limited_greedy" else 1
    return dataclasses.replace(glm4moe.hf_sigmoid_moe({**cfg, "n_group": groups}),
                               scoring="softmax",
                               top_groups=int(cfg.get("topk_group") or 1) if groups > 1 else 1,
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "deepseek2")
    rope_dim = int(g("rope.dimension_count"))
    key = int(g("attention.key_length_mla", 0)) or int(g("attention.key_length"))
    q_rank = g("attention.q_lora_rank", None)
    mla = MlaConfig(int(g("attention.kv_lora_rank")), key - rope_dim, rope_dim,
                    int(g("attention.value_length_mla", 0)) or int(g("attention.value_length")),
                    None if not q_rank else int(q_rank))
    base = llama.config_from_gguf(meta, arch="deepseek2")
    base = dataclasses.replace(base, num_layers=base.num_layers
                               - int(g("nextn_predict_layers", 0)))
    rope, mscale = _gguf_rope(g)
    return _mla_config(base, mla, rope, mscale, _gguf_moe(meta, g))


def _gguf_rope(g: Any) -> tuple[RopeConfig, float]:
    """RoPE as llama.cpp's deepseek2 reads it: YaRN with cos/sin unscaled, the softmax
    scale's mscale from yarn_log_multiplier (its converter writes 0.1 * mscale_all_dim)."""
    theta = float(g("rope.freq_base", 10000.0))
    factor = float(g("rope.scaling.factor", 1.0))
    if g("rope.scaling.type", "none") != "yarn" or factor <= 1:
        return RopeConfig(theta=theta), 1.0
    log_mul = float(g("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    yarn = Yarn(factor, int(g("rope.scaling.original_context_length")), 1.0,
                float(g("rope.scaling.yarn_beta_fast", 32.0)),
                float(g("rope.scaling.yarn_beta_slow", 1.0)))
    return RopeConfig(theta=theta, yarn=yarn), yarn_mscale(factor, log_mul) if log_mul else 1.0


def _gguf_moe(meta: dict[str, Any], g: Any) -> MoeConfig | None:
    """The experts of a GGUF; groups with softmax gating are V2's group_limited_greedy, each
    group ranked by its best score as the checkpoint was trained (llama.cpp ranks every
    family's groups by their two best)."""
    if not g("expert_count", 0):
        return None
    base = moe.moe_from_gguf(meta, "deepseek2", norm_topk_prob=False)
    sigmoid = int(g("expert_gating_func", 1)) == 2
    return dataclasses.replace(
        base, shared_intermediate_size=int(g("expert_shared_count", 0))
        * base.expert_intermediate_size, scoring="sigmoid" if sigmoid else "softmax",
        groups=int(g("expert_group_count", 1)), top_groups=int(g("expert_group_used_count", 1)),
        routed_scale=float(g("expert_weights_scale", 1.0)))


def _mla_config(base: ModelConfig, mla: MlaConfig, rope: RopeConfig, mscale: float,
                routing: MoeConfig | None) -> ModelConfig:
    """The family's config: one KV "head" (the latent), heads of qk_nope + qk_rope dims."""
    head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return dataclasses.replace(base, num_kv_heads=1, head_dim=head, rope=rope, mla=mla,
                               attn_scale=head ** -0.5 * mscale * mscale, moe=routing)


def _pairs_to_halves(t: torch.Tensor, heads: int, head: int, rope: int) -> torch.Tensor:
    """Rows [heads * head, ...] whose last `rope` rows per head are rotary pairs (x0, x1,
    x2, x3, ...) -> those rows as halves (x0, x2, ..., x1, x3, ...)."""
    w = t.reshape(heads, head, *t.shape[1:]).clone()
    w[:, head - rope:] = llama.unpermute_qk(w[:, head - rope:].reshape(heads * rope,
                                                                        *t.shape[1:]), heads
                                            ).reshape(heads, rope, *t.shape[1:])
    return w.reshape(t.shape)


def _transform(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Both loaders: the rotary rows of q (each head's last qk_rope) and of kv_a (its last
    qk_rope, the shared key part) laid out as halves."""
    m = config.mla
    if name in ("q", "q_b"):
        return _pairs_to_halves(t, config.num_heads, config.head_dim, m.qk_rope_head_dim)
    if name == "kv_a":
        return _pairs_to_halves(t, 1, m.latent_width, m.qk_rope_head_dim)
    return t


def _dense(w: Weight) -> torch.Tensor:
    return dequantize(w).float() if isinstance(w, QuantizedWeight) else w.float()


def _absorbed(config: ModelConfig, layer: dict[str, Weight]) -> dict[str, torch.Tensor]:
    """W_UK [heads, qk_nope, rank] and W_UV^T [heads, rank, v_head_dim] of a layer, from
    kv_b (HF) or llama.cpp's k_b [heads, rank, qk_nope] and v_b [heads, v_head_dim, rank]."""
    m, heads = config.mla, config.num_heads
    if "kv_b" in layer:
        kv_b = _dense(layer["kv_b"]).reshape(heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        w_uk, w_uv = kv_b.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    else:
        w_uk = _dense(layer["k_b"]).reshape(heads, m.kv_lora_rank, -1).transpose(1, 2)
        w_uv = _dense(layer["v_b"]).reshape(heads, m.v_head_dim, -1)
    like = layer["kv_a"]  # dense weights keep their dtype and device (GPUs: bf16 products)
    to = ({"dtype": like.dtype, "device": like.device} if isinstance(like, torch.Tensor)
          else {"dtype": torch.float32})
    return {"w_uk": w_uk.to(**to).contiguous(), "w_uv_t": w_uv.transpose(1, 2).to(**to).contiguous()}


class DeepseekModel(moe.MoeModel):
    """The MoE decoder with latent attention; decode runs in the one-call C layers (their
    plan's latent-attention fields) where every product has a C kernel."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ModelLoadError("latent attention (deepseek2) runs on one rank only")
        self.config, self.weights, self.tp = config, weights, tp
        self.layers = [{**layer, **_absorbed(config, layer)} for layer in layers]
        rope = config.rope
        self.inv_freq = RopeTable(ScaledRope.build(
            rope, rope_inv_freq(rope, config.mla.qk_rope_head_dim)).to(weights["norm"].device),
            config.max_position_embeddings)
        self.inv_freq_local, self.rope_dtype = None, torch.float32
        self.c_plan = decode_c.build_plan(config, self.layers, "silu")
        self.gpu_plan = None  # the fused GPU layers take per-head K/V

    def attention(self, h: torch.Tensor, layer: dict[str, Weight], cos: torch.Tensor,
                  sin: torch.Tensor, cache: KVStore, meta: AttentionMetadata,
                  sliding: bool, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]: absorbed attention over the latent cache."""
        c, m = self.config, self.config.mla
        q = self._queries(h, layer, cos, sin)  # [T, H, nope + rope]
        kv = linear(h, layer["kv_a"])  # [T, rank + rope]
        latent = rms_norm(kv[:, :m.kv_lora_rank].contiguous(), layer["kv_a_norm"],
                          c.rms_norm_eps)
        k_rope = apply_rope(kv[:, None, m.kv_lora_rank:], cos, sin).to(latent.dtype)
        keys = torch.cat([latent[:, None], k_rope], dim=-1)  # [T, 1, rank + rope]
        if _latent_in_c(q, layer, cache, meta):
            cache.write(meta.write_slots(False), keys, None)
            values = _attend_latent_c(q, layer, cache, meta, c.scale)
        else:
            values = self._attend_absorbed(q, keys, layer, cache, meta)
        return linear(values, layer["o"])

    def _attend_absorbed(self, q: torch.Tensor, keys: torch.Tensor, layer: dict[str, Weight],
                         cache: KVStore, meta: AttentionMetadata) -> torch.Tensor:
        """The same attention with W_UK and W_UV as torch products around paged_attention
        (GPUs, or stores and weights the C latent attention does not take): [T, H * vdim]."""
        c, m = self.config, self.config.mla
        w_uk, w_uv_t = layer["w_uk"], layer["w_uv_t"]
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)
        queries = torch.cat([q_lat, q_rope.to(q_lat.dtype)], dim=-1)  # [T, H, rank + rope]
        out = paged_attention(queries, keys, keys[..., :m.kv_lora_rank], cache, meta,
                              sliding=False, scale=c.scale)  # [T, H * rank]
        out = out.view(-1, c.num_heads, m.kv_lora_rank).transpose(0, 1)
        values = torch.bmm(out.to(w_uv_t.dtype), w_uv_t).transpose(0, 1)  # [T, H, v_head_dim]
        return values.reshape(len(q), -1)

    def _queries(self, h: torch.Tensor, layer: dict[str, Weight], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Per head [T, H, nope + rope]: q_nope, then the rotated part."""
        c, m = self.config, self.config.mla
        if "q_a" in layer:
            q = linear(rms_norm(linear(h, layer["q_a"]), layer["q_a_norm"], c.rms_norm_eps),
                       layer["q_b"])
        else:
            q = linear(h, layer["q"])
        q = q.view(-1, c.num_heads, c.head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, apply_rope(q_rope, cos, sin).to(q_nope.dtype)], dim=-1)


def _latent_in_c(q: torch.Tensor, layer: dict[str, Weight], cache: KVStore,
                 meta: AttentionMetadata) -> bool:
    """Whether the C latent attention (qk_mla.c) takes the whole step: fp32 queries and
    absorbed weights on the CPU, a store it reads, every group a decode or a one-sequence
    prefill."""
    if not (isinstance(cache, LatentKV) and cache.c_stores() is not None
            and fused.fits(q, layer["w_uk"], layer["w_uv_t"])):
        return False
    return all((g.lengths is not None and g.queries_per_seq == 1)
               or (g.prefill and g.num_seqs == 1) for g in meta.groups(False))


def _attend_latent_c(q: torch.Tensor, layer: dict[str, Weight], cache: LatentKV,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, nope + rope] -> [T, H * vdim], group by group from the latent store."""
    w_uk, w_uv_t = layer["w_uk"], layer["w_uv_t"]
    groups = meta.groups(False)
    whole = len(groups) == 1 and groups[0].rows.numel() == len(q)  # rows 0..T-1 in order
    out = None if whole else q.new_empty(len(q), q.shape[1] * w_uv_t.shape[2])
    for g in groups:
        qg = q if out is None else q.index_select(0, g.rows)
        if g.prefill:
            og = fused.mla_prefill(qg, cache.k, w_uk, w_uv_t, g.slots[0], g.first, g.start,
                                   scale)
        else:
            og = fused.mla_decode(qg, cache.k, w_uk, w_uv_t, g.slots, scale, g.lengths)
        if out is None:
            return og
        out.index_copy_(0, g.rows, og)
    return out


SPEC = ArchSpec(
    name="deepseek2", model_cls=DeepseekModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    gguf_transform=_transform, hf_transform=_transform,
    hf_architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"))
