"""Checkpoint -> ModelConfig + model object, through the architecture's name table.

Quantized GGUF tensors stay in their block format (QuantizedWeight) unless the caller asks
for dense weights; on CUDA with triton installed the types Triton kernels multiply stay in
their blocks too, repacked as planes (PackedWeight), the others are dequantized; float
tensors are cast to the compute dtype; norms and biases stay fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.config import ModelConfig
from kvlab.cost import LayerSpec, ModelSpec
from kvlab.errors import ModelLoadError
from kvlab.kernels import (
    SUPPORTED_TYPES,
    QuantizedWeight,
    can_group,
    dequantize,
    group_rows,
    quantize,
)
from kvlab.kernels.packed import PackedWeight, pack
from kvlab.metrics import RunCost
from kvlab.models import find_arch
from kvlab.models.layers import Stacked, Weight, packs_on
from kvlab.models.moe import Experts
from kvlab.models.mtp import MtpLayer, build_mtp, has_mtp, mtp_table
from kvlab.models.pooling import gguf_pooling, hf_pooling
from kvlab.models.sharding import (
    SINGLE,
    TensorParallel,
    check_columns,
    local_config,
    shard_ranges,
    take,
)
from kvlab.models.spec import ArchSpec, NameTable
from kvlab.weights.checkpoint import Checkpoint, RawTensor

QUANTIZE_CHOICES = ("q8_0", "q6_k", "q5_k", "q4_k")  # kvlab's own quantizers (C)
_SUPPORTED = {t.name for t in SUPPORTED_TYPES}
_STACKED = (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up")),
            ("shexp_gate_up", ("shexp_gate", "shexp_up")))
# routers stay as stored: a top-k choice flips on small changes, and they are small; so do
# experts' bias rows (gpt-oss: [experts, out], not matrices of a product)
_DENSE = {"router", "shexp_router", "gate_up_exps_bias", "gate_exps_bias", "up_exps_bias",
          "down_exps_bias"}
# dense on GPUs too: latent attention (deepseek2) folds these into per-head tensors at load
_DENSE_ON_GPU = _DENSE | {"kv_a", "kv_b", "k_b", "v_b"}


@dataclass(frozen=True)
class LoadOptions:
    dtype: torch.dtype = torch.float32
    # GGUF quant blocks stay as they are in memory (CPU kernels); on CUDA with triton, those
    # of kvlab.kernels.packed's PACKED_TYPES stay quantized in planes (Triton kernels)
    keep_quantized: bool = True
    device: str = "cpu"  # on CUDA, other quantized weights are dequantized to `dtype` at load
    quantize: str | None = None  # quantize dense 2-D weights at load: QUANTIZE_CHOICES
    # CPU: matrices of 8k rows of the types in kvlab.layouts.GROUPS_AS in 8-row groups (Q8_0x8,
    # Q4_Kx8, ...: exact values; batched decode and prefill 1.3-2x faster, batch-1 no slower)
    group_rows: bool = True
    # load the checkpoint's first multi-token-prediction layer, if it has one (kvlab.models.mtp)
    mtp: bool = False


@dataclass(frozen=True)
class TensorStat:
    name: str  # kvlab name, e.g. "layers.3.q"
    shape: tuple[int, ...]
    qtype: str  # storage type in memory: "Q4_K", "F32", ...
    nbytes: int
    stored_nbytes: int  # as the checkpoint stores it (8-row groups or F16 -> F32 differ)

    @property
    def routed(self) -> bool:
        """One routed expert's matrix ("layers.3.down_exps.5"): read only when chosen."""
        return "_exps." in self.name


@dataclass(frozen=True)
class LoadedModel:
    spec: ArchSpec
    config: ModelConfig
    model: Any  # the architecture's model class
    tensors: tuple[TensorStat, ...]
    pooling: str = "last"  # how embeddings pool its hidden states (kvlab.models.pooling)
    mtp: MtpLayer | None = None  # its multi-token-prediction layer, when asked and present

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_weight_bytes(self) -> int:
        return sum(t.stored_nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts it does not pick
        (the whole embedding and head included, as MoE model names count them)."""
        routed = sum(math.prod(t.shape) for t in self.tensors if t.routed)
        return self.num_params - round(routed * (1 - self._routed_share))

    @property
    def _routed_share(self) -> float:
        """Share of the routed experts one token reads: experts_used / experts."""
        moe = self.config.moe
        return moe.experts_per_token / moe.num_experts if moe else 1.0

    def run_cost(self, kv_bytes_per_element: float, window_released: bool = False) -> RunCost:
        """What a token costs an engine running this model with that KV dtype."""
        stored = self.model_spec(stored=True).decode_weight_bytes(1)
        return RunCost(self.model_spec(), kv_bytes_per_element, window_released, round(stored))

    def model_spec(self, stored: bool = False) -> ModelSpec:
        """This model in the estimator's cost vocabulary, from the tensors as loaded (in
        memory; `stored`: as the checkpoint stores them): per-layer bytes and matmul
        parameters, KV width and window, the embedding and output tables."""
        c = self.config
        size = (lambda t: t.stored_nbytes) if stored else (lambda t: t.nbytes)
        by_layer: dict[int, list[TensorStat]] = {i: [] for i in range(c.num_layers)}
        outside = []
        for t in self.tensors:
            parts = t.name.split(".")
            (by_layer[int(parts[1])] if parts[0] == "layers" else outside).append(t)
        embed = next(t for t in outside if t.name == "embed")
        head = next((t for t in outside if t.name == "lm_head"), None)
        output = head or embed
        return ModelSpec(
            name=c.name or c.architecture, source="loaded", n_params=self.num_params,
            weight_bytes=sum(map(size, self.tensors)),
            layers=tuple(self._layer_spec(i, by_layer[i], size) for i in range(c.num_layers)),
            lookup_params=math.prod(embed.shape), lookup_row_bytes=size(embed) // embed.shape[0],
            output_params=c.vocab_size * c.hidden_size, output_bytes=size(output),
            other_bytes=sum(size(t) for t in outside if t not in (embed, head)),
            experts=c.moe.num_experts if c.moe else 0,
            experts_used=c.moe.experts_per_token if c.moe else 0,
            max_context=c.max_position_embeddings, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, tied_output=head is None, architecture=c.architecture)

    def _layer_spec(self, layer: int, tensors: list[TensorStat],
                    size: Callable[[TensorStat], int]) -> LayerSpec:
        c = self.config
        matmul = [t for t in tensors if len(t.shape) == 2]
        return LayerSpec(
            dense_bytes=sum(size(t) for t in tensors if not t.routed),
            dense_params=sum(math.prod(t.shape) for t in matmul if not t.routed),
            kv_elements=(0 if not c.is_attention(layer) else c.mla.latent_width if c.mla
                         else 2 * c.num_kv_heads * c.head_dim),
            attn_flop_per_key=4 * c.num_heads * c.head_dim if c.is_attention(layer) else 0,
            state_bytes=(4 * c.recurrent.state_elements
                         if c.recurrent and c.is_recurrent(layer) else 0),
            window=c.sliding_window if c.is_sliding(layer) else None,
            expert_bytes=sum(size(t) for t in tensors if t.routed),
            expert_params=sum(math.prod(t.shape) for t in matmul if t.routed),
            heads=c.num_heads, kv_heads=c.num_kv_heads, ffn_width=c.intermediate_size)


def read_config(ckpt: Checkpoint) -> tuple[ArchSpec, ModelConfig]:
    """The checkpoint's architecture and its whole model's config."""
    gguf = ckpt.format == "gguf"
    spec = find_arch(ckpt.architecture, ckpt.metadata if gguf else None)
    return spec, (spec.config_from_gguf if gguf else spec.config_from_hf)(ckpt.metadata)


def load_model(ckpt: Checkpoint, options: LoadOptions,
               tp: TensorParallel = SINGLE) -> LoadedModel:
    """The model, or with tp.size > 1 rank tp.rank's shard of it (kvlab.models.sharding):
    its config then has this rank's heads and MLP columns, its tensors this rank's slices."""
    gguf = ckpt.format == "gguf"
    spec, full = read_config(ckpt)
    config = local_config(full, tp)
    table = spec.gguf_names if gguf else spec.hf_names
    transform = spec.gguf_transform if gguf else spec.hf_transform
    names = ckpt.names()

    stats: list[TensorStat] = []

    def convert(raw: RawTensor, dst: str, stat_name: str,
                read: Callable[[int, int], None] | None = None) -> Weight:
        stored = raw.data.data_ptr()
        raw = RawTensor(raw.shape, raw.qtype, transform(full, dst, raw.data))
        if tp.size > 1:
            raw = _shard(raw, dst, stat_name, full, tp, options.quantize)
        # `read` spans are the stored tensor's: only while raw still is those bytes
        same = raw.data.data_ptr() == stored and tp.size == 1
        dense = dst in (_DENSE if options.device == "cpu" else _DENSE_ON_GPU)
        w = _convert(raw, options, dense=dense, read=read if same else None)
        stats.append(_stat(stat_name, w, raw.data.numel() * raw.data.element_size()))
        return w

    def get(src: str, dst: str, stat_name: str) -> Weight | tuple[Weight, ...]:
        raw = ckpt.read(src)
        if len(raw.shape) == 3 and not dst.endswith("_exps"):
            raw = _heads_as_rows(raw)  # per-head matrices (llama.cpp's attn_k_b)
        if len(raw.shape) == 3 and dst.endswith("_exps"):  # a layer's experts, stacked
            w = tuple(convert(sub, dst, f"{stat_name}.{e}")
                      for e, sub in enumerate(_expert_slices(raw)))
        else:  # a large matrix's pages go as its rows are grouped, not all after
            w = convert(raw, dst, stat_name, lambda a, b: ckpt.release_pages(src, a, b))
        ckpt.release_pages(src)  # w is built: the file's pages need not stay resident
        return w

    def get_layer(i: int, stat: str = "layers", names_of: NameTable = table
                  ) -> dict[str, Weight | tuple[Weight, ...]]:
        layer = {dst: get(src, dst, f"{stat}.{i}.{dst}")
                 for src, dst in _layer_names(names_of, i, names)}
        for srcs, dst in _expert_names(names_of, i, names):
            layer[dst] = tuple(get(src, dst, f"{stat}.{i}.{dst}.{e}")
                               for e, src in enumerate(srcs))
        return layer

    weights = {dst: get(src, dst, dst) for src, dst in table.globals.items() if src in names}
    layers = [get_layer(i) for i in range(config.num_layers)]
    _check_present(weights, layers, ckpt, spec, full)
    fused = spec.fused_sizes(config) if spec.fused_sizes else {}
    model = spec.model_cls(config, weights,
                           _stack_all(layers, fused, spec.expert_activation), tp)
    mtp, n = None, config.num_layers  # the first MTP layer follows the main ones
    mtp_names = mtp_table(table, gguf, spec.hf_mtp_names)
    if options.mtp and tp.size == 1 and has_mtp(mtp_names, n, names):  # stats: "mtp.N.*"
        mtp = build_mtp(spec.model_cls, config, weights,
                        _stack(get_layer(n, "mtp", mtp_names), fused))
    return LoadedModel(spec, config, model, tuple(stats), _pooling(ckpt, spec), mtp)


def _pooling(ckpt: Checkpoint, spec: ArchSpec) -> str:
    """The checkpoint's own pooling for embeddings, else the architecture's default."""
    if ckpt.format == "gguf":
        found = gguf_pooling(ckpt.metadata, str(ckpt.metadata.get("general.architecture")))
    else:
        found = hf_pooling(ckpt.path) if ckpt.path.is_dir() else None
    return found or spec.pooling


def _stack_all(layers: list[dict], fused_sizes: dict[str, tuple[int, ...]],
               expert_activation: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> list[dict]:
    """_stack on each layer in turn, each unstacked layer dropped from `layers` as it goes:
    the copies stacking makes (gate|up of every expert, q|k|v) then never sit beside all the
    originals, which would lift the peak RSS of a load by their size."""
    out = []
    while layers:
        out.append(_stack(layers.pop(0), fused_sizes, expert_activation))
    return out


def _expert_slices(raw: RawTensor) -> list[RawTensor]:
    """[experts, out, in] -> one [out, in] RawTensor per expert, views of the same bytes
    (quantized blocks are sliced along the expert axis, never dequantized)."""
    n, shape = raw.shape[0], raw.shape[1:]
    data = raw.data.view(n, shape[0], -1) if raw.quantized else raw.data
    return [RawTensor(shape, raw.qtype, data[e]) for e in range(n)]


def _heads_as_rows(raw: RawTensor) -> RawTensor:
    """[heads, rows, cols] -> one matrix [heads * rows, cols] of the same bytes
    (quantized blocks run along cols, so the heads' rows just follow each other)."""
    shape = (raw.shape[0] * raw.shape[1], raw.shape[2])
    data = raw.data.reshape(shape[0], -1) if raw.quantized else raw.data.reshape(shape)
    return RawTensor(shape, raw.qtype, data)


def _expert_names(table: NameTable, i: int, names: set[str]) -> list[tuple[list[str], str]]:
    """Per-expert checkpoint names of layer i, expert 0 up, for each kvlab name present."""
    prefix, out = table.layer_prefix.format(i=i), []
    for src, dst in table.experts.items():
        found: list[str] = []
        while (name := prefix + src.format(e=len(found))) in names:
            found.append(name)
        if found:
            out.append((found, dst))
    return out


def _stack(layer: dict[str, Weight], fused_sizes: dict[str, tuple[int, ...]],
           expert_activation: Callable[[torch.Tensor], torch.Tensor] | None = None
           ) -> dict[str, Weight | Stacked]:
    """q/k/v -> "qkv" and gate/up -> "gate_up": one product over the same input each (a
    checkpoint that stores them fused already gives the one matrix, split by its sizes)."""
    out: dict[str, Weight | Stacked] = dict(layer)
    for fused, names in _STACKED:
        if fused in layer:
            out[fused] = Stacked((layer[fused],), fused_sizes[fused])
        elif all(n in layer for n in names):
            out[fused] = Stacked.of([out.pop(n) for n in names])
    if "down_exps" in layer:
        out["experts"] = _experts(out, expert_activation)
    biases = [layer.get(f"{n}_bias") for n in ("q", "k", "v")]
    if all(b is not None for b in biases):
        out["qkv_bias"] = torch.cat(biases)
    return out


def _experts(layer: dict,
             activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Experts:
    """A layer's expert matrices (tuples, one weight per expert) -> Experts, gate|up of each
    expert stacked into one product as a dense layer's are; experts without a gate product
    (the architecture's expert_activation set) run up, the activation, down."""
    if activation is not None:
        return Experts(tuple(Stacked.of([u]) for u in layer.pop("up_exps")),
                       layer.pop("down_exps"), gate=activation)
    if "gate_up_exps" in layer:  # stored fused: [2 * inter, hidden] per expert
        gate_up = tuple(Stacked((w,), (w.shape[0] // 2, w.shape[0] // 2))
                        for w in layer.pop("gate_up_exps"))
    else:
        gate_up = tuple(Stacked.of([g, u])
                        for g, u in zip(layer.pop("gate_exps"), layer.pop("up_exps")))
    return Experts(gate_up, layer.pop("down_exps"))


def _layer_names(table: NameTable, i: int, names: set[str]) -> list[tuple[str, str]]:
    prefix = table.layer_prefix.format(i=i)
    return [(prefix + src, dst) for src, dst in table.layer.items() if prefix + src in names]


def _check_present(weights: dict[str, Weight], layers: list[dict[str, Weight]],
                   ckpt: Checkpoint, spec: ArchSpec, config: ModelConfig) -> None:
    """Embeddings, and each layer's MLP and attention (a recurrent layer's own tensors are
    its architecture's to check)."""
    missing = ["embed"] if "embed" not in weights else []
    for i, layer in enumerate(layers):
        required = set()
        if config.is_attention(i):  # o, and q/k/v, gate/up, each set alone or fused
            required = {"o"} | ({"qkv"} if "qkv" in layer else _attention_names(config, i))
        if config.mla is not None:  # latent attention: q, kv_a, kv_b (or k_b, v_b), o
            required = {"o", "kv_a"}
        if config.has_mlp(i):
            required |= _mlp_names(layer, spec.gated_mlp, spec.expert_activation is None)
        missing += [f"layer {i} {n}" for n in sorted(required - set(layer))]
    if missing:
        raise ModelLoadError(f"{ckpt.path} lacks tensors the {ckpt.architecture} "
                             f"architecture needs: {', '.join(missing[:5])}")


def _attention_names(config: ModelConfig, layer: int) -> set[str]:
    """q, k and v; q alone where the layer reads another's K/V, q and k where its values
    are its keys (Gemma 4's attention_k_eq_v on full-attention layers)."""
    if not config.owns_kv(layer):
        return {"q"}
    return {"q", "k"} if config.values_from_keys(layer) else {"q", "k", "v"}


def _mlp_names(layer: dict, gated: bool = True, gated_experts: bool = True) -> set[str]:
    """What a layer's MLP needs: the dense SwiGLU (up and down alone where the MLP has no
    gate), or (with a router) the experts, likewise."""
    if "router" not in layer:
        if not gated:
            return {"up", "down"}
        return {"down"} | ({"gate_up"} if "gate_up" in layer else {"gate", "up"})
    if not gated_experts:
        return {"up_exps", "down_exps"}
    return {"down_exps"} | ({"gate_up_exps"} if "gate_up_exps" in layer
                            else {"gate_exps", "up_exps"})


def _shard(raw: RawTensor, dst: str, stat_name: str, config: ModelConfig,
           tp: TensorParallel, quantize: str | None) -> RawTensor:
    """Rank tp.rank's slice of a (transformed) tensor; the whole tensor where replicated.
    A column split of quantized blocks (as stored, or as --quantize will make them) must
    fall on block boundaries."""
    found = shard_ranges(dst, config, tp, raw.shape) if len(raw.shape) <= 2 else None
    if found is None:  # replicated (stacked experts are sliced one by one: _expert_slices)
        return raw
    axis, ranges = found
    shape = list(raw.shape)
    shape[axis] = sum(b - a for a, b in ranges)
    qtype = None
    if axis == 1:
        qtype = (GGMLQuantizationType[raw.qtype] if raw.quantized
                 else _quant_type_for(raw.shape[1], quantize))
    if qtype is not None:
        block = GGML_QUANT_SIZES[qtype]
        check_columns(stat_name, qtype.name, raw.shape[1], ranges, block[0], tp.size)
    scale = GGML_QUANT_SIZES[qtype] if qtype is not None and raw.quantized else (1, 1)
    return RawTensor(tuple(shape), raw.qtype, take(raw.data, axis, ranges, scale))


def _convert(raw: RawTensor, options: LoadOptions, dense: bool = False,
             read: Callable[[int, int], None] | None = None) -> Weight:
    if raw.qtype not in _SUPPORTED:
        raise ModelLoadError(f"tensor type {raw.qtype} is not supported "
                             f"(valid: {', '.join(sorted(_SUPPORTED))})")
    on_cpu = options.device == "cpu"
    if raw.quantized:
        # row permutations (the transform) work on the block bytes too
        w = QuantizedWeight(GGMLQuantizationType[raw.qtype], raw.shape, raw.data)
        if options.keep_quantized and on_cpu:
            return _grouped(w, options, read)
        if options.keep_quantized and not dense and packs_on(w, options.device):
            return pack(w, options.dtype, options.device)
        return dequantize(w).to(device=options.device, dtype=options.dtype)
    t = raw.data
    if t.dim() < 2:
        return t.float().to(options.device)
    qtype = _quant_type_for(t.shape[-1], options.quantize) if on_cpu and not dense else None
    return _grouped(quantize(t.float(), qtype), options) if qtype else t.to(options.device,
                                                                             options.dtype)


def _grouped(w: QuantizedWeight, options: LoadOptions,
             read: Callable[[int, int], None] | None = None) -> QuantizedWeight:
    return group_rows(w, read) if options.group_rows and can_group(w) else w


def _quant_type_for(cols: int, wanted: str | None) -> GGMLQuantizationType | None:
    """The asked-for type, or (as llama.cpp's quantizer does) Q8_0 for rows whose length is
    not a multiple of the type's block, or None (stay dense) when neither fits."""
    if wanted is None:
        return None
    for qtype in (GGMLQuantizationType[wanted.upper()], GGMLQuantizationType.Q8_0):
        if cols % GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return None


def _stat(name: str, w: Weight, stored: int) -> TensorStat:
    if isinstance(w, QuantizedWeight):
        return TensorStat(name, tuple(w.shape), w.type_name, w.nbytes, stored)
    if isinstance(w, PackedWeight):
        return TensorStat(name, tuple(w.shape), w.qtype.name, w.nbytes, stored)
    kind = str(w.dtype).removeprefix("torch.").replace("float", "F").replace("bF", "BF")
    return TensorStat(name, tuple(w.shape), kind, w.numel() * w.element_size(), stored)
