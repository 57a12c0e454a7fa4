"""Checkpoint -> ModelConfig + model object, through the architecture's name table.

Quantized GGUF tensors stay in their block format (QuantizedWeight) unless the caller asks
for dense weights; float tensors are cast to the compute dtype; norms and biases stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.kernels import QuantizedWeight, dequantize, quantize
from kvlab.models import find_arch
from kvlab.models.layers import Weight
from kvlab.models.spec import ArchSpec, NameTable
from kvlab.weights import Checkpoint, RawTensor

QUANTIZE_CHOICES = ("q8_0", "q4_k")


@dataclass(frozen=True)
class LoadOptions:
    dtype: torch.dtype = torch.float32
    keep_quantized: bool = True  # GGUF quant blocks stay as they are in memory
    quantize: str | None = None  # quantize dense 2-D weights at load: "q8_0" | "q4_k"


@dataclass(frozen=True)
class LoadedModel:
    spec: ArchSpec
    config: ModelConfig
    model: Any  # the architecture's model class
    weight_bytes: int  # resident bytes of all weights


def load_model(ckpt: Checkpoint, options: LoadOptions) -> LoadedModel:
    spec = find_arch(ckpt.architecture)
    gguf = ckpt.format == "gguf"
    config = (spec.config_from_gguf if gguf else spec.config_from_hf)(ckpt.metadata)
    table = spec.gguf_names if gguf else spec.hf_names
    transform = spec.gguf_transform if gguf else spec.hf_transform
    names = ckpt.names()

    def get(src: str, dst: str) -> Weight:
        return _convert(ckpt.read(src), lambda t: transform(config, dst, t), options)

    weights = {dst: get(src, dst) for src, dst in table.globals.items() if src in names}
    layers = [{dst: get(src, dst) for src, dst in _layer_names(table, i, names)}
              for i in range(config.num_layers)]
    _check_present(weights, layers, ckpt)
    model = spec.model_cls(config, weights, layers)
    total = sum(_nbytes(w) for w in weights.values())
    total += sum(_nbytes(w) for layer in layers for w in layer.values())
    return LoadedModel(spec, config, model, total)


def _layer_names(table: NameTable, i: int, names: set[str]) -> list[tuple[str, str]]:
    prefix = table.layer_prefix.format(i=i)
    return [(prefix + src, dst) for src, dst in table.layer.items() if prefix + src in names]


def _check_present(weights: dict[str, Weight], layers: list[dict[str, Weight]],
                   ckpt: Checkpoint) -> None:
    required_layer = {"q", "k", "v", "o", "gate", "up", "down"}
    missing = [f"embed"] if "embed" not in weights else []
    for i, layer in enumerate(layers):
        missing += [f"layer {i} {n}" for n in sorted(required_layer - set(layer))]
    if missing:
        raise ModelLoadError(f"{ckpt.path} lacks tensors the {ckpt.architecture} "
                             f"architecture needs: {', '.join(missing[:5])}")


def _convert(raw: RawTensor, transform: Any, options: LoadOptions) -> Weight:
    if raw.quantized:
        rows = transform(raw.data)  # row permutations work on the block bytes too
        w = QuantizedWeight(GGMLQuantizationType[raw.qtype], raw.shape, rows)
        return w if options.keep_quantized else dequantize(w).to(options.dtype)
    t = transform(raw.data)
    if t.dim() < 2:
        return t.float()
    if options.quantize:
        return quantize(t.float(), GGMLQuantizationType[options.quantize.upper()])
    return t.to(options.dtype)


def _nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
