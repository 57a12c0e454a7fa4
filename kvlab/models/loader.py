"""Checkpoint -> ModelConfig + model object, through the architecture's name table.

Quantized GGUF tensors stay in their block format (QuantizedWeight) unless the caller asks
for dense weights; float tensors are cast to the compute dtype; norms and biases stay fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.kernels import (
    SUPPORTED_TYPES,
    QuantizedWeight,
    can_group,
    dequantize,
    group_rows,
    quantize,
)
from kvlab.metrics import ModelCost
from kvlab.models import find_arch
from kvlab.models.layers import Stacked, Weight
from kvlab.models.spec import ArchSpec, NameTable
from kvlab.weights import Checkpoint, RawTensor

QUANTIZE_CHOICES = ("q8_0", "q6_k", "q5_k", "q4_k")  # kvlab's own quantizers (C)
_SUPPORTED = {t.name for t in SUPPORTED_TYPES}


@dataclass(frozen=True)
class LoadOptions:
    dtype: torch.dtype = torch.float32
    keep_quantized: bool = True  # GGUF quant blocks stay as they are in memory (CPU kernels)
    device: str = "cpu"  # on CUDA, quantized weights are dequantized to `dtype` at load
    quantize: str | None = None  # quantize dense 2-D weights at load: QUANTIZE_CHOICES
    # CPU: matrices of 8k rows of the types in kernels.ops.GROUPS_AS in 8-row groups (Q8_0x8,
    # Q4_Kx8, ...: exact values; batched decode and prefill 1.3-2x faster, batch-1 no slower)
    group_rows: bool = True


@dataclass(frozen=True)
class TensorStat:
    name: str  # kvlab name, e.g. "layers.3.q"
    shape: tuple[int, ...]
    qtype: str  # storage type in memory: "Q4_K", "F32", ...
    nbytes: int
    stored_nbytes: int  # as the checkpoint stores it (8-row groups or F16 -> F32 differ)


@dataclass(frozen=True)
class LoadedModel:
    spec: ArchSpec
    config: ModelConfig
    model: Any  # the architecture's model class
    tensors: tuple[TensorStat, ...]

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_weight_bytes(self) -> int:
        return sum(t.stored_nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    def cost(self, kv_bytes_per_element: float) -> ModelCost:
        c = self.config
        embed = next(t for t in self.tensors if t.name == "embed")
        tied = not any(t.name == "lm_head" for t in self.tensors)
        matmul = sum(math.prod(t.shape) for t in self.tensors
                     if t.name.startswith("layers.") and len(t.shape) == 2)
        return ModelCost(
            decode_weight_bytes=self._decode_bytes(embed, tied, stored=False),
            decode_stored_bytes=self._decode_bytes(embed, tied, stored=True),
            matmul_params=matmul,
            head_params=c.vocab_size * c.hidden_size,
            kv_bytes_per_token=int(c.kv_bytes_per_token(kv_bytes_per_element)),
            attn_flops_per_key=4 * c.num_layers * c.num_heads * c.head_dim,
            sliding_layer_share=sum(map(c.is_sliding, range(c.num_layers))) / c.num_layers,
            window=c.sliding_window)


    def _decode_bytes(self, embed: TensorStat, tied: bool, stored: bool) -> int:
        """Weight bytes a batch-1 decode step reads: every matrix once, one embedding row,
        the embedding again as the output head when tied; in memory or as stored."""
        total, emb = ((self.stored_weight_bytes, embed.stored_nbytes) if stored
                      else (self.weight_bytes, embed.nbytes))
        return total - emb + emb // embed.shape[0] + (emb if tied else 0)


def load_model(ckpt: Checkpoint, options: LoadOptions) -> LoadedModel:
    spec = find_arch(ckpt.architecture)
    gguf = ckpt.format == "gguf"
    config = (spec.config_from_gguf if gguf else spec.config_from_hf)(ckpt.metadata)
    table = spec.gguf_names if gguf else spec.hf_names
    transform = spec.gguf_transform if gguf else spec.hf_transform
    names = ckpt.names()

    stats: list[TensorStat] = []

    def get(src: str, dst: str, stat_name: str) -> Weight:
        raw = ckpt.read(src)
        w = _convert(raw, lambda t: transform(config, dst, t), options)
        stats.append(_stat(stat_name, w, raw.data.numel() * raw.data.element_size()))
        ckpt.release_pages(src)  # w is built: the file's pages need not stay resident
        return w

    weights = {dst: get(src, dst, dst) for src, dst in table.globals.items() if src in names}
    layers = [{dst: get(src, dst, f"layers.{i}.{dst}")
               for src, dst in _layer_names(table, i, names)} for i in range(config.num_layers)]
    _check_present(weights, layers, ckpt)
    fused = spec.fused_sizes(config) if spec.fused_sizes else {}
    model = spec.model_cls(config, weights, [_stack(layer, fused) for layer in layers])
    return LoadedModel(spec, config, model, tuple(stats))


def _stack(layer: dict[str, Weight],
           fused_sizes: dict[str, tuple[int, ...]]) -> dict[str, Weight | Stacked]:
    """q/k/v -> "qkv" and gate/up -> "gate_up": one product over the same input each (a
    checkpoint that stores them fused already gives the one matrix, split by its sizes)."""
    out: dict[str, Weight | Stacked] = dict(layer)
    for fused, names in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        if fused in layer:
            out[fused] = Stacked((layer[fused],), fused_sizes[fused])
            continue
        out[fused] = Stacked.of([out.pop(n) for n in names])
    biases = [layer.get(f"{n}_bias") for n in ("q", "k", "v")]
    if all(b is not None for b in biases):
        out["qkv_bias"] = torch.cat(biases)
    return out


def _layer_names(table: NameTable, i: int, names: set[str]) -> list[tuple[str, str]]:
    prefix = table.layer_prefix.format(i=i)
    return [(prefix + src, dst) for src, dst in table.layer.items() if prefix + src in names]


def _check_present(weights: dict[str, Weight], layers: list[dict[str, Weight]],
                   ckpt: Checkpoint) -> None:
    missing = ["embed"] if "embed" not in weights else []
    for i, layer in enumerate(layers):
        required = {"o", "down"}  # and q/k/v, gate/up, each set alone or fused
        required |= {"qkv"} if "qkv" in layer else {"q", "k", "v"}
        required |= {"gate_up"} if "gate_up" in layer else {"gate", "up"}
        missing += [f"layer {i} {n}" for n in sorted(required - set(layer))]
    if missing:
        raise ModelLoadError(f"{ckpt.path} lacks tensors the {ckpt.architecture} "
                             f"architecture needs: {', '.join(missing[:5])}")


def _convert(raw: RawTensor, transform: Any, options: LoadOptions) -> Weight:
    if raw.qtype not in _SUPPORTED:
        raise ModelLoadError(f"tensor type {raw.qtype} is not supported "
                             f"(valid: {', '.join(sorted(_SUPPORTED))})")
    on_cpu = options.device == "cpu"
    if raw.quantized:
        rows = transform(raw.data)  # row permutations work on the block bytes too
        w = QuantizedWeight(GGMLQuantizationType[raw.qtype], raw.shape, rows)
        if options.keep_quantized and on_cpu:
            return _grouped(w, options)
        return dequantize(w).to(device=options.device, dtype=options.dtype)
    t = transform(raw.data)
    if t.dim() < 2:
        return t.float().to(options.device)
    qtype = _quant_type_for(t.shape[-1], options.quantize) if on_cpu else None
    return _grouped(quantize(t.float(), qtype), options) if qtype else t.to(options.device,
                                                                             options.dtype)


def _grouped(w: QuantizedWeight, options: LoadOptions) -> QuantizedWeight:
    return group_rows(w) if options.group_rows and can_group(w) else w


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
    kind = str(w.dtype).removeprefix("torch.").replace("float", "F").replace("bF", "BF")
    return TensorStat(name, tuple(w.shape), kind, w.numel() * w.element_size(), stored)
