"""A dense model's decode layers as one C call (kvlab.kernels._qk.decode_layers).

When every product of the model has a C kernel, the KV cache is fp32 or fp16 on the CPU and
the step is pure decode, the C side runs all layers: the same C functions, in the same order
and on the same layouts as the C path of the model's own forward (Gemma 3's, Llama's and the
Qwen files built on it), so the logits are bit-identical, without the dozen Python calls a
layer between them. The plan is built once at load: per layer, the addresses and sizes of
its weights as int64 [layers, fields] (the K/V store addresses are added per cache list):

    attn_norm, n_qkv, qkv[3] x (qtype, ptr, rows, cols, row_bytes), qkv_bias, q_norm,
    k_norm, sinks, o (5), post_attn_norm, mlp_norm, n_gate_up, gate_up[2] x (5), gate, down (5),
    post_mlp_norm, sliding, qk_norm_whole, router, n_experts, top_k, norm_topk, experts,
    shexp_gate, o_bias, scoring, router_bias, groups, top_groups, routed_scale, gate_up_bias,
    down_bias, expert_clamp, clamp_alpha, clamp_limit, shexp_ungated, head_dim, kv_heads,
    kv_shared, values_from_keys, v_norm, ple_gate (5), ple_out (5), ple_col, ple_post_norm,
    layer_scalar, router_norm, experts_norm, expert_scale, shexp_out_norm, experts_out_norm,
    expert_gelu, mla, q_a (5), q_b (5), kv_a (5), q_a_norm, kv_a_norm, w_uk, w_uv_t, rank,
    rope, vdim

with, between shexp_ungated and head_dim, a recurrent layer's fields and the gated
attention's options: mixer, n_rc_in, rc_in[4] (5 each), rc_out (5), conv, conv_k, ssm_a,
dt_bias, rc_norm, k_heads, v_heads, k_dim, v_dim, v_tiled, q_gate, rotary, then Mamba-2's
and the other hybrid families' own: ssm_d, rc_in_bias, conv_bias, rc_out_bias, dt_min,
dt_max, residual_scale, expert_relu2, latent_in (5), latent_out (5).

A norm the family does not have is 0 (Llama: no QK-norm, residual adds without post norms;
OLMo 2: no norm before attention and MLP, only after);
`gate` picks gelu_tanh (Gemma's GeGLU) or silu (SwiGLU). Gemma 2's soft-cap on the
attention scores is one scalar of the step, as the per-op path passes it to the same C
attention. A mixture-of-experts layer has a router (fp32 [E, hidden]) and its experts'
table (moe.Experts.c_table) in place of the dense MLP; the C side routes in fp32 as
moe.route does, so its logits equal the per-op path's up to fp32 rounding of the router and
gates (not bit for bit). A shared expert (Qwen2-MoE's) is then the layer's gate_up and down,
and shexp_gate its fp32 gate vector [hidden]: its output, scaled by sigmoid(shexp_gate . h),
is added to the routed experts' sum. `sinks` (gpt-oss) is the layer's fp32 [H] sink logits,
which the C attention folds into each head's softmax, and `o_bias` its o product's bias.
The router scores as the family does (`scoring`): softmax over all experts (DeepSeek-V2:
within the `top_groups` of `groups` whose best score is highest); gpt-oss's top k
of the logits plus `router_bias`, softmax over those k; GLM-4.5's sigmoid scores, chosen by
score + `router_bias` within the best `top_groups` of `groups`, weights times routed_scale
(floats are held as their fp32 bits). gpt-oss's experts add their bias rows and run the
clamped SwiGLU (expert_clamp, alpha, limit) in the one C experts call; GLM-4.5's shared
expert is added without a gate (shexp_ungated). DeepSeek-V2/V3's latent attention (mla 1)
takes the place of qkv: q from q_b after q_a and its norm (or one q product: q_a all 0),
the latent and rotary key part from kv_a, and the absorbed W_UK [H, nope, rank] and
W_UV^T [H, rank, vdim] in fp32 (deepseek2._absorbed); its store holds rank + rope per token.

Gemma 4's options: a layer's own head size and KV heads where they differ from the config's
(head_dim, kv_heads; its RoPE table is the step's full or sliding one, as wide); a layer
whose K/V is another's (config.kv_source) writes none and attends over that layer's store
(kv_shared; its products are q alone); values equal to the keys before their norm where the
products are q|k (values_from_keys) and v_norm, the values' per-head norm; after the MLP the
per-layer input: ple_gate and ple_out (F32 products where the loader left them dense), its
column in the step's per-layer rows [T, layers * dim] that the model computes once per step
(run's `ple`), the normed add, then layer_scalar, fp32 [1] times x. Its MoE layers put the
dense MLP in the shared expert's place (ungated, GeGLU as the model's gate) and read x
through their own norms: router_norm, experts_norm, each output normed (shexp_out_norm,
experts_out_norm) before the sum; the chosen weights times expert_scale [E]; GeGLU experts
(expert_gelu).

Hybrid models (LFM2, Qwen3.5, Granite 4 hybrid, Nemotron-H): a recurrent layer mixes its
tokens by its state in attention's place (mixer): KV_MIX_SHORT_CONV, rc_in's b | c | u,
c * conv(b * u) by the C short convolution on each sequence's conv state row, rc_out (conv
fp32 [C, K]); KV_MIX_GATED_DELTA, Qwen3.5's Gated DeltaNet (rc_in its qkv | z | b | a
products, the conv with SiLU, the C delta rule on the recurrent state row, the gated norm,
rc_out); KV_MIX_MAMBA2 (rc_in its in_proj -> z | xBC | dt, the conv with its bias and SiLU,
dt's softplus clamped to [dt_min, dt_max], the C SSD step with A and the skip ssm_d, the
grouped gated norm, rc_out; k_heads, k_dim its groups and state size, v_heads, v_dim its
heads and head size; its products' biases rc_in_bias, rc_out_bias). The step's state
tables (each layer's state tensors, each sequence's row) come in with the step as the KV
stores do. Qwen3.5's attention layers gate their output by sigmoid of a second half of
each head's q product (q_gate) and rotate the first `rotary` dims of each head. Granite's
residual multiplier is residual_scale (x += scale * out in one rounding, as torch's
add_(alpha)); its shared MLP beside routed experts is their ungated shared expert.
Nemotron-H's layers are one sublayer each: a Mamba-2 or attention layer has no MLP
(n_gate_up 0), an MLP layer mixes nothing (KV_MIX_NONE) and reads x through its one norm
(as mlp_norm); its MLPs and shared expert are down(relu(up)^2) (gate relu2, up alone as
gate_up), its experts too (expert_relu2), Nemotron-3 Super's in a latent (latent_in
before them, latent_out after). A step of several tokens of one sequence (a speculative
verify) is not a decode step: it takes the per-op path; its dense MLP's biases are the
experts' bias fields (gate_up_bias, down_bias: one row). LFM2 layers with biases have no
fields: their plans are refused (None).
"""

from __future__ import annotations

import struct

import torch
from gguf import GGMLQuantizationType

from kvlab.config import ModelConfig
from kvlab.kernels import QuantizedWeight, fused
from kvlab.kernels.ops import _qk
from kvlab.models.attention import AttentionGroup, AttentionMetadata, KVStore
from kvlab.models.layers import Stacked, geglu, relu2
from kvlab.models.state_store import LayerState, StateBatch

_EMPTY = [0, 0, 0, 0, 0]
GATES = {"gelu_tanh": 0, "silu": 1, "relu2": 2}  # KV_GATE_* in csrc/qk_decode.h
SCORINGS = {"softmax": 0, "topk_softmax": 1, "sigmoid": 2}  # KV_ROUTE_*
MIX_SHORT_CONV, MIX_GATED_DELTA, MIX_MAMBA2, MIX_NONE = 1, 2, 3, 4  # KV_MIX_*
# OLMo 2 has no attn_norm / mlp_norm (its norms come after the products: the post norms)
_OPTIONAL = ("attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm", "sinks", "post_attn_norm",
             "post_mlp_norm")


class Plan:
    def __init__(self, weights: torch.Tensor, sources: list[int | None], ple_width: int,
                 stateful: list[bool]) -> None:
        self.weights = weights  # int64 [layers, fields]
        # per layer, the layer whose K/V store it reads; None: a recurrent layer or an MLP
        # layer (no KV)
        self.sources = sources
        self.stateful = stateful  # per layer: whether it keeps a recurrent state
        self.ple_width = ple_width  # the per-layer inputs' row width run takes, 0: none
        self._caches: list[KVStore] | None = None
        self._table: torch.Tensor | None = None
        self.kv_kind = 0  # the checked stores: 0 fp32, 1 fp16, 2 q8_0
        self.recurrent = any(stateful)
        self._states: tuple[LayerState | None, ...] | None = None
        self._state_table: torch.Tensor | None = None

    def caches(self, kv_caches: list[KVStore]) -> torch.Tensor | None:
        """int64 [layers, 4]: each layer's K and V store and (q8_0) their scales, or None when
        the C attention cannot read them all as one kind; checked and built once per cache
        list (the runner's own). `kv_kind` tells which kind."""
        if kv_caches is not self._caches:
            ok = len(kv_caches) == self.weights.shape[0]
            stores = [None if s is None else kv_caches[s].c_stores()
                      for s in self.sources] if ok else []
            kinds = {_kind(st) for st, s in zip(stores, self.sources) if s is not None}
            ok = ok and len(kinds) == 1 and None not in kinds
            self._caches = kv_caches
            self._table = torch.tensor(
                [[0] * 4 if st is None else [t.data_ptr() if t is not None else 0 for t in st]
                 for st in stores], dtype=torch.int64) if ok else None
            self.kv_kind = kinds.pop() if ok else 0
        return self._table

    def states(self, states: StateBatch | None, rows: int) -> torch.Tensor | None:
        """int64 [layers, 2]: each recurrent layer's conv and recurrent state tensors (0 for
        attention layers and absent ones), built once per state list (the runner's own); None
        when the step's states are not one fp32 CPU row per sequence of one token each."""
        if states is None or not _one_token_rows(states, rows):
            return None
        if states.layers is not self._states:
            ok = len(states.layers) == self.weights.shape[0] and all(
                (st is not None) == stateful and (st is None or _state_ok(st))
                for st, stateful in zip(states.layers, self.stateful))
            self._states = states.layers
            self._state_table = torch.tensor(
                [[0, 0] if st is None else [st.conv.data_ptr(), 0 if st.recurrent is None
                                            else st.recurrent.data_ptr()]
                 for st in states.layers], dtype=torch.int64) if ok else None
        return self._state_table


def _one_token_rows(states: StateBatch, rows: int) -> bool:
    """One state row per sequence and one token each: a decode step (a verify step's several
    tokens of one sequence are not)."""
    slots, lens = states.slots, states.lens
    return (slots.numel() == rows and lens.numel() == rows and _int64(slots) and _int64(lens)
            and bool((lens == 1).all()))


def _state_ok(st: LayerState) -> bool:
    return all(t is None or (fused.fits(t) and t.is_contiguous())
               for t in (st.conv, st.recurrent))


def _kind(stores: tuple | None) -> int | None:
    """The C attention's kind of a store's c_stores(): 0 fp32, 1 fp16, 2 q8_0."""
    if stores is None:
        return None
    return {torch.float32: 0, torch.float16: 1, torch.int8: 2}[stores[0].dtype]


def build_plan(config: ModelConfig, layers: list[dict], gate: str,
               output_gate: bool = False) -> Plan | None:
    """The plan, or None when some product or norm has no C path (dense or F32 weights).
    output_gate: the attention layers' q products give each head's query then its output
    gate (Qwen3.5)."""
    if _qk is None or not layers or (config.no_rope_layers and config.sliding_window):
        return None  # layers without RoPE take the second table, which sliding ones need
    rows = []
    for i, layer in enumerate(layers):
        row = _layer_row(layer, config, i, gate, output_gate)
        if row is None:
            return None
        rows.append(row)
    weights = torch.tensor(rows, dtype=torch.int64)
    sources = [config.kv_source(i) if config.is_attention(i) else None
               for i in range(len(layers))]
    ple_width = sum(layer["ple_gate"].shape[0] for layer in layers if "ple_gate" in layer)
    ok = weights.shape[1] == _qk.plan_fields()
    stateful = [config.is_recurrent(i) for i in range(len(layers))]
    return Plan(weights, sources, ple_width, stateful) if ok else None


def _layer_row(layer: dict, config: ModelConfig, i: int, gate: str,
               output_gate: bool) -> list[int] | None:
    latent, attends = config.mla is not None, config.is_attention(i)
    if config.layer_types[i] == "mlp":  # no mixer: its one norm feeds the MLP
        layer = {n: w for n, w in layer.items() if n != "attn_norm"} | {
            "mlp_norm": layer["attn_norm"]}
    mixer = _mixer_fields(layer, config, i, output_gate)
    if not attends:
        attention = _norm_fields(layer, _EMPTY)
    else:
        attention = (_latent_attention_fields(layer) if latent
                     else _attention_fields(layer, config))
    post = _norm(layer.get("post_mlp_norm"))
    mla = _mla_fields(layer, config) if latent else [0] * _MLA_FIELDS
    mlp, moe, routing = _mlp_fields(layer, config, i, gate)
    o_bias = _norm(layer.get("o_bias"))
    own = _layer_shape_fields(layer, config, i) if attends else [0] * 5
    tail, beside = _tail_fields(layer, i), _beside_fields(layer)
    after = _after_mixer_fields(layer, config, i)
    if None in (attention, mlp, moe, post, o_bias, routing, mla, own, tail, beside, mixer, after):
        return None
    # the one flag picks the second RoPE table and the sliding window's attention
    return [*attention, *mlp, post, int(config.second_rope(i)), int(config.qk_norm_whole),
            *moe, o_bias, *routing, *mixer, *after, *own, *tail, *beside, *mla]


def _mlp_fields(layer: dict, config: ModelConfig, i: int,
                gate: str) -> tuple[list[int] | None, list[int] | None, list[int] | None]:
    """The dense MLP's (or shared expert's), the experts' and the routing fields; all 0 for
    a layer without an MLP (Nemotron-H's mixer layers)."""
    if "router" in layer:
        return (_shared_expert_fields(layer, gate), _moe_fields(layer, config),
                _routing_fields(layer, config))
    if not config.has_mlp(i):
        return [0, *_EMPTY * 2, 0, *_EMPTY], [0] * 6, [0] * 11
    # biases (Nemotron-H's relu2 MLP's) in the experts' bias fields, a dense layer's one row
    biases = [_norm(layer.get(n)) for n in ("up_bias", "down_bias")]
    if any(biases) and gate != "relu2" or None in biases:
        return None, None, None
    routing = [0] * 5 + biases + [0] * 4
    return _dense_fields(layer.get("gate_up"), layer.get("down"), gate), [0] * 6, routing


_AFTER_MIXER_FIELDS = 18


def _after_mixer_fields(layer: dict, config: ModelConfig, i: int) -> list[int] | None:
    """ssm_d, rc_in_bias, conv_bias, rc_out_bias, dt_min, dt_max (a Mamba-2 layer's, else
    0), residual_scale (0: 1), expert_relu2, latent_in (5), latent_out (5)."""
    scale = 0 if config.residual_scale == 1.0 else _f32_bits(config.residual_scale)
    squared = int("experts" in layer and layer["experts"].gate is relu2)
    latent = ([kernel_desc(layer["latent_in"]), kernel_desc(layer["latent_out"])]
              if "latent_in" in layer else [_EMPTY, _EMPTY])
    if None in latent:
        return None
    experts = [scale, squared, *latent[0], *latent[1]]
    if not (config.is_recurrent(i) and config.recurrent.kind == "mamba2"):
        return [0] * 6 + experts
    vectors = [_norm(layer.get(n), n != "D") for n in
               ("D", "in_proj_bias", "conv_bias", "out_proj_bias")]
    if None in vectors:
        return None
    lo, hi = config.recurrent.time_step_limit
    return [*vectors, _f32_bits(lo), _f32_bits(hi), *experts]


_MIXER_FIELDS = 39
_NO_MIXER = [0] * (_MIXER_FIELDS - 2)  # all but q_gate and rotary


def _short_conv_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """The mixer fields of an LFM2 convolution layer (rc_in, rc_out, conv, conv_k); None for
    biases (the C layer has none) or channels other than the hidden size."""
    rc = config.recurrent
    if any(n in layer for n in ("conv_in_bias", "conv_bias", "conv_out_bias")):
        return None
    rc_in, rc_out, conv = kernel_desc(layer["conv_in"]), kernel_desc(layer["conv_out"]), layer["conv"]
    ok = (rc_in is not None and rc_out is not None and fused.fits(conv) and conv.is_contiguous()
          and rc.conv_channels == config.hidden_size and rc_in[2] == 3 * rc.conv_channels
          and rc_out[3] == rc.conv_channels
          and tuple(conv.shape) == (rc.conv_channels, rc.conv_kernel))
    if not ok:
        return None
    return [MIX_SHORT_CONV, 1, *rc_in, *_EMPTY * 3, *rc_out, conv.data_ptr(), rc.conv_kernel,
            *[0] * 10]


def _gated_delta_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """The mixer fields of a Qwen3.5 Gated DeltaNet layer: delta_in's four products, its
    out-projection, conv, A, dt bias, output norm and head shapes."""
    rc = config.recurrent
    parts = layer["delta_in"].parts  # b and a are narrow: F32 where the loader left them
    if len(parts) > 4:
        return None
    rc_in = [product_desc(p) for p in parts] + [_EMPTY] * (4 - len(parts))
    rc_out, conv = kernel_desc(layer["delta_out"]), layer["conv"]
    vectors = [_norm(layer[n], False) for n in ("ssm_a", "dt_bias", "delta_norm")]
    if None in (*rc_in, rc_out, *vectors) or not (fused.fits(conv) and conv.is_contiguous()):
        return None
    return [MIX_GATED_DELTA, len(parts), *[v for d in rc_in for v in d], *rc_out, conv.data_ptr(),
            rc.conv_kernel, *vectors, rc.num_k_heads, rc.num_v_heads, rc.k_head_dim,
            rc.v_head_dim, int(rc.v_heads_tiled), 0, 0]


def _mamba2_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """The mixer fields of a Mamba-2 layer: in_proj, out_proj, conv, A, dt bias, the gated
    norm's weight, and its shapes (k_heads: groups, k_dim: state size, v_heads: heads,
    v_dim: head size); its D, biases and dt limits are among the last fields."""
    rc = config.recurrent
    rc_in, rc_out, conv = kernel_desc(layer["in_proj"]), kernel_desc(layer["out_proj"]), layer["conv"]
    vectors = [_norm(layer[n], False) for n in ("ssm_a", "dt_bias", "norm")]
    ok = (fused.fits(conv) and conv.is_contiguous()
          and tuple(conv.shape) == (rc.conv_channels, rc.conv_kernel))
    if None in (rc_in, rc_out, *vectors) or not ok:
        return None
    return [MIX_MAMBA2, 1, *rc_in, *_EMPTY * 3, *rc_out, conv.data_ptr(), rc.conv_kernel,
            *vectors, rc.ssm_groups, rc.ssm_heads, rc.ssm_state_size, rc.ssm_head_dim, 0, 0, 0]


def _mixer_fields(layer: dict, config: ModelConfig, i: int,
                  output_gate: bool) -> list[int] | None:
    """mixer, n_rc_in, rc_in[4], rc_out, conv, conv_k, ssm_a, dt_bias, rc_norm, k_heads,
    v_heads, k_dim, v_dim, v_tiled, q_gate, rotary; None for a recurrent kind the C layers do
    not run."""
    if config.is_recurrent(i):
        kind = config.recurrent.kind
        fields = {"short_conv": _short_conv_fields, "gated_delta": _gated_delta_fields,
                  "mamba2": _mamba2_fields}.get(kind)
        return None if fields is None else fields(layer, config)
    if not config.is_attention(i):  # an MLP layer
        return [MIX_NONE, *_NO_MIXER[1:], 0, 0]
    if not output_gate:
        return [*_NO_MIXER, 0, 0]
    return [*_NO_MIXER, 1, round(config.head_dim * config.rope.partial)]


def _layer_shape_fields(layer: dict, config: ModelConfig, i: int) -> list[int] | None:
    """head_dim, kv_heads (0: the config's), kv_shared, values_from_keys, v_norm."""
    dim, kv_heads = config.layer_head_dim(i), config.layer_kv_heads(i)
    v_norm = _norm(layer.get("v_norm"))
    if v_norm is None:
        return None
    return [dim if dim != config.head_dim else 0,
            kv_heads if kv_heads != config.num_kv_heads else 0,
            int(not config.owns_kv(i)), int("qk" in layer), v_norm]


def _tail_fields(layer: dict, i: int) -> list[int] | None:
    """ple_gate, ple_out, ple_col, ple_post_norm, layer_scalar: what follows the MLP."""
    scalar = layer.get("layer_scalar")
    if scalar is not None and not (fused.fits(scalar) and scalar.numel() == 1):
        return None
    scalar_ptr = 0 if scalar is None else scalar.data_ptr()
    if "ple_gate" not in layer:
        return [*_EMPTY * 2, 0, 0, scalar_ptr]
    gate, out = product_desc(layer["ple_gate"]), product_desc(layer["ple_out"])
    norm = _norm(layer.get("ple_post_norm"))
    if None in (gate, out, norm):
        return None
    return [*gate, *out, i * gate[2], norm, scalar_ptr]


def _beside_fields(layer: dict) -> list[int] | None:
    """router_norm, experts_norm, expert_scale, shexp_out_norm, experts_out_norm,
    expert_gelu: experts beside a dense MLP (Gemma 4's MoE layers), all 0 elsewhere."""
    norms = [_norm(layer.get(n)) for n in ("router_norm", "experts_norm", "expert_scale",
                                           "shexp_out_norm", "experts_out_norm")]
    if None in norms:
        return None
    gelu = "experts" in layer and layer["experts"].gate is geglu
    return [*norms, int(gelu)]


def _attention_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """attn_norm, n_qkv, qkv, qkv_bias, q_norm, k_norm, sinks, o, post_attn_norm,
    mlp_norm. The products are q|k|v, or (Gemma 4) q|k where the values are the keys, or q
    alone where the layer reads another's K/V."""
    products = next((layer[n] for n in ("qkv", "qk") if n in layer), None)
    products = Stacked.of([layer["q"]]) if products is None else products
    qkv, o = _parts(products, 3), kernel_desc(layer["o"])
    norms = {n: _norm(layer.get(n), n in _OPTIONAL)
             for n in ("attn_norm", "qkv_bias", "q_norm", "k_norm", "sinks", "post_attn_norm",
                       "mlp_norm")}
    if qkv is None or o is None or None in norms.values():
        return None
    if config.qk_norm_whole and not (norms["q_norm"] and norms["k_norm"]):
        return None
    n = norms
    return [n["attn_norm"], len(products.parts), *qkv, n["qkv_bias"], n["q_norm"],
            n["k_norm"], n["sinks"], *o, n["post_attn_norm"], n["mlp_norm"]]


def _latent_attention_fields(layer: dict) -> list[int] | None:
    """The attention fields of a latent-attention layer: its norms and o, no qkv."""
    o = kernel_desc(layer["o"])
    return None if o is None else _norm_fields(layer, o)


def _norm_fields(layer: dict, o: list[int]) -> list[int] | None:
    """The attention fields of a layer without qkv (latent attention, a recurrent layer):
    its norms and o (or none)."""
    attn_norm, mlp_norm = _norm(layer.get("attn_norm")), _norm(layer.get("mlp_norm"))
    if None in (attn_norm, mlp_norm):
        return None
    return [attn_norm, 0, *_EMPTY * 3, 0, 0, 0, 0, *o, 0, mlp_norm]


_MLA_FIELDS = 23


def _mla_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """mla, q_a, q_b, kv_a, q_a_norm, kv_a_norm, w_uk, w_uv_t, rank, rope, vdim; None when a
    product has no C kernel or the absorbed matrices are not fp32 on the CPU."""
    m, low_rank = config.mla, "q_a" in layer
    q_a = kernel_desc(layer["q_a"]) if low_rank else _EMPTY
    q_b, kv_a = kernel_desc(layer["q_b" if low_rank else "q"]), kernel_desc(layer["kv_a"])
    norms = [_norm(layer.get("q_a_norm"), not low_rank), _norm(layer.get("kv_a_norm"), False)]
    w_uk, w_uv_t = layer["w_uk"], layer["w_uv_t"]
    if (None in (q_a, q_b, kv_a, *norms) or not fused.fits(w_uk, w_uv_t)
            or not (w_uk.is_contiguous() and w_uv_t.is_contiguous())):
        return None
    return [1, *q_a, *q_b, *kv_a, *norms, w_uk.data_ptr(), w_uv_t.data_ptr(), m.kv_lora_rank,
            m.qk_rope_head_dim, m.v_head_dim]


def _dense_fields(gate_up: object, down: object, gate: str) -> list[int] | None:
    """n_gate_up, gate_up[2], gate, down."""
    parts, down_desc = _parts(gate_up, 2), kernel_desc(down)
    if parts is None or down_desc is None:
        return None
    return [len(gate_up.parts), *parts, GATES[gate], *down_desc]


def _shared_expert_fields(layer: dict, gate: str) -> list[int] | None:
    """An MoE layer's dense MLP fields: its shared expert (the model's gate: SwiGLU, or
    Gemma 4's GeGLU dense MLP beside the experts), or none (n_gate_up 0)."""
    if "shexp_gate_up" not in layer:
        return [0, *_EMPTY * 2, GATES["silu"], *_EMPTY]
    return _dense_fields(layer["shexp_gate_up"], layer["shexp_down"], gate)


def _moe_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """router, n_experts, top_k, norm_topk, experts, shexp_gate; None for experts without C
    kernels or a router or shared-expert gate the C side cannot read."""
    experts, moe = layer["experts"], config.moe
    e, k = moe.num_experts, moe.experts_per_token
    router = _gate_rows(layer["router"], e, config)
    gated = "shexp_router" in layer
    shexp_gate = _gate_rows(layer["shexp_router"], 1, config) if gated else 0
    if experts.c_table is None or not 0 < k <= e <= 256 or None in (router, shexp_gate):
        return None
    return [router, e, k, int(moe.norm_topk_prob), experts.c_table.data_ptr(), shexp_gate]


def _routing_fields(layer: dict, config: ModelConfig) -> list[int] | None:
    """scoring, router_bias, groups, top_groups, routed_scale, gate_up_bias, down_bias,
    expert_clamp, clamp_alpha, clamp_limit, shexp_ungated; None for a scoring or a bias
    the C side cannot take."""
    moe, experts = config.moe, layer["experts"]
    bias = _norm(layer.get("router_bias"))
    gate_up, down = _bias_rows(experts.gate_up_bias), _bias_rows(experts.down_bias)
    if moe.scoring not in SCORINGS or None in (bias, gate_up, down):
        return None
    # the C grouped top k needs whole groups, and the kept ones holding the k
    groups_fit = (moe.num_experts % moe.groups == 0 and 0 < moe.top_groups <= moe.groups
                  and moe.experts_per_token <= moe.top_groups * (moe.num_experts // moe.groups))
    if (moe.scoring == "sigmoid" or moe.groups > 1) and not groups_fit:
        return None
    clamp = None if experts.gate in (None, geglu, relu2) else experts.gate  # gpt-oss's
    alpha, limit = (clamp.alpha, clamp.limit) if clamp is not None else (0.0, 0.0)
    ungated = "shexp_gate_up" in layer and "shexp_router" not in layer
    return [SCORINGS[moe.scoring], bias, moe.groups, moe.top_groups, _f32_bits(moe.routed_scale),
            gate_up, down, int(clamp is not None), _f32_bits(alpha), _f32_bits(limit),
            int(ungated)]


def _bias_rows(w: torch.Tensor | None) -> int | None:
    """The address of an experts' fp32 bias rows [E, width], 0 for none."""
    if w is None:
        return 0
    return w.data_ptr() if fused.fits(w) and w.dim() == 2 and w.is_contiguous() else None


def _f32_bits(v: float) -> int:
    """A float as the plan holds it: its fp32 bits in an int64 field."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _gate_rows(w: object, rows: int, config: ModelConfig) -> int | None:
    """The address of an fp32 gate [rows, hidden] (a router, a shared expert's gate), or
    None when the C products cannot read it."""
    ok = (isinstance(w, torch.Tensor) and fused.fits(w) and w.is_contiguous()
          and tuple(w.shape) == (rows, config.hidden_size))
    return w.data_ptr() if ok else None


def _parts(stacked: object, most: int) -> list[int] | None:
    parts = getattr(stacked, "parts", None)
    if parts is None or len(parts) > most:
        return None
    descs = [kernel_desc(p) for p in parts]
    if None in descs:
        return None
    return [v for d in descs for v in d] + _EMPTY * (most - len(parts))


def product_desc(w: object) -> list[int] | None:
    """kernel_desc, or an fp32 matrix [rows, cols] on the CPU as the C F32 product takes it
    (a weight the loader left dense: too narrow for quantized blocks)."""
    if isinstance(w, torch.Tensor) and fused.fits(w) and w.dim() == 2 and w.is_contiguous():
        return [int(GGMLQuantizationType.F32), w.data_ptr(), w.shape[0], w.shape[1],
                w.shape[1] * 4]
    return kernel_desc(w)


def kernel_desc(w: object) -> list[int] | None:
    """What the C products take of a weight; None for dense tensors and F32 blocks (those
    go through torch)."""
    if not isinstance(w, QuantizedWeight) or w.qtype == GGMLQuantizationType.F32:
        return None
    return list(w.kernel_args)


def _norm(w: torch.Tensor | None, optional: bool = True) -> int | None:
    """The address of an fp32 vector (a norm's weight, a bias); 0 when the layer has none
    and may do without; None when the C layers cannot take it."""
    if w is None:
        return 0 if optional else None
    ok = fused.fits(w) and w.dim() == 1 and w.is_contiguous()
    return w.data_ptr() if ok else None


def run(plan: Plan, config: ModelConfig, x: torch.Tensor,
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]], kv_caches: list[KVStore | None],
        meta: AttentionMetadata, ple: torch.Tensor | None = None,
        states: StateBatch | None = None) -> bool:
    """All layers on x [T, hidden] in place; False (nothing done) when the step does not fit.
    ropes[True] is the cos/sin of the layers the plan marks for the second table: sliding
    ones, or (a model without a window) those without RoPE, whose table is the identity.
    ple: the step's per-layer inputs fp32 [T, layers * dim] (Gemma 4), or None. states: the
    recurrent layers' rows (hybrid models), one per sequence."""
    full, local = _decode_group(meta.groups_full, x), _decode_group(meta.groups_sliding, x)
    caches = plan.caches(kv_caches)
    ple_ok = (plan.ple_width == 0 if ple is None else
              fused.fits(ple) and ple.is_contiguous() and tuple(ple.shape) == (
                  x.shape[0], plan.ple_width))
    state_table = plan.states(states, x.shape[0]) if plan.recurrent else None
    if full is None or local is None or caches is None or not ple_ok or not _fits(x, ropes, meta):
        return False
    if plan.recurrent and state_table is None:
        return False
    (cos_g, sin_g), (cos_l, sin_l) = ropes[False], ropes[True]
    c, w = config, plan.weights
    _qk.decode_layers(
        w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], x.shape[1],
        c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.scale, cos_g.data_ptr(),
        sin_g.data_ptr(), cos_l.data_ptr(), sin_l.data_ptr(), meta.slot_mapping.data_ptr(),
        meta.write_slots(True).data_ptr(),
        full.slots.data_ptr(), full.slots.shape[1], full.lengths.data_ptr(),
        local.slots.data_ptr(), local.slots.shape[1], local.lengths.data_ptr(),
        caches.data_ptr(), plan.kv_kind, c.attn_logit_softcapping or 0.0,
        0 if ple is None else ple.data_ptr(), 0 if ple is None else ple.shape[1],
        0 if state_table is None else state_table.data_ptr(),
        0 if state_table is None else states.slots.data_ptr())
    return True


def _decode_group(groups: tuple[AttentionGroup, ...], x: torch.Tensor) -> AttentionGroup | None:
    """The step's one decode group (one query per sequence, every row of x), or None."""
    if len(groups) != 1:
        return None
    g = groups[0]
    ok = (g.lengths is not None and g.queries_per_seq == 1 and g.num_seqs == x.shape[0]
          and _int64(g.slots) and _int64(g.lengths))
    return g if ok else None


def _fits(x: torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
          meta: AttentionMetadata) -> bool:
    tables = [t for pair in ropes.values() for t in pair]
    return (fused.fits(x, *tables) and x.dim() == 2 and x.is_contiguous()
            and all(t.is_contiguous() for t in tables) and _int64(meta.slot_mapping)
            and _int64(meta.write_slots(True)))


def _int64(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.is_cpu and t.is_contiguous()
