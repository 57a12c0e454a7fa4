"""Build a `ModelSpec` from a GGUF file, an HF config.json, or a bare description.

GGUF: bytes and parameters come from the tensor directory (no tensor data is read), the
attention shape and sliding windows from the metadata; a hybrid's recurrent layers (those
with ssm_* or shortconv tensors) keep a state per sequence sized from the ssm.* /
shortconv.* metadata as llama.cpp's converter writes it, and no KV. HF config.json: parameters from
the architecture, bytes from the dtype (or --bits). Description: `--params 8e9 --bits 4.5`
plus whatever of layers / KV heads / head dim / vocab / hidden is known.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.config import GLOBAL_EVERY, ModelConfig, hf_layer_types, interleaved_layer_types
from kvlab.cost import LayerSpec, MatrixSpec, ModelSpec
from kvlab.errors import KvlabError, ModelLoadError
from kvlab.weights.gguf_file import GGUFFile, TensorInfo

# Every `global_every`-th layer attends globally, the others within the sliding window
# (layer i is global when (i + 1) % global_every == 0), as llama.cpp and HF lay them out.
HF_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float8_e4m3fn": 8}


def load_model_spec(path: str | Path, bits: float | None = None) -> ModelSpec:
    """A .gguf file, a config.json, or a directory holding config.json."""
    p = Path(path).expanduser()
    if p.is_dir():
        return spec_from_hf_config(p, bits)
    if p.suffix == ".json":
        return spec_from_hf_config(p, bits)
    if bits is not None:
        raise KvlabError("--bits applies to a config.json or a description; a GGUF file "
                         "already says how its weights are stored")
    return spec_from_gguf(p)


# -- GGUF ---------------------------------------------------------------------------------


def spec_from_gguf(path: str | Path) -> ModelSpec:
    gguf = GGUFFile(path)
    md, arch = gguf.metadata, gguf.architecture

    def meta(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    n_layers = int(_required(meta("block_count"), f"{arch}.block_count", gguf.path))
    hidden = int(_required(meta("embedding_length"), f"{arch}.embedding_length", gguf.path))
    blocks, lookups, output, others = _group_tensors(gguf.tensors.values(), n_layers)
    shapes = _attention_shapes(meta, n_layers, hidden)
    windows = _gguf_windows(arch, meta, n_layers)
    ffn = _per_layer(meta("feed_forward_length", 0), n_layers)
    state = 4 * _gguf_state_elements(meta, hidden)
    layers = tuple(_gguf_layer(b, (0, 0, s[2], 0) if _is_recurrent(b) else s, w, f,
                               state if _is_recurrent(b) else 0)
                   for b, s, w, f in zip(blocks, shapes, windows, ffn))
    embd = gguf.tensors.get("token_embd.weight")
    tied = output is None and embd is not None
    out = embd if tied else output
    return ModelSpec(
        name=str(md.get("general.name") or Path(gguf.path).stem), source="gguf",
        n_params=sum(_numel(t) for t in gguf.tensors.values()),
        weight_bytes=sum(t.nbytes for t in gguf.tensors.values()), layers=layers,
        lookup_params=sum(_numel(t) for t in lookups),
        lookup_row_bytes=sum(t.nbytes // t.shape[0] for t in lookups),
        output_params=_numel(out) if out else 0, output_bytes=out.nbytes if out else 0,
        other_bytes=sum(t.nbytes for t in others),
        experts=int(meta("expert_count") or 0), experts_used=int(meta("expert_used_count") or 0),
        max_context=_int_or_none(meta("context_length")),
        vocab_size=embd.shape[0] if embd else None, hidden_size=hidden, tied_output=tied,
        output_matrix=_matrix(out) if out and len(out.shape) == 2 else None,
        architecture=str(arch))


def _matrix(t: TensorInfo) -> MatrixSpec:
    """'blk.3.attn_q.weight' -> a matrix named 'attn_q'."""
    parts = t.name.split(".")
    role = parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]
    return MatrixSpec(t.qtype.name, t.shape[0], t.shape[1], t.nbytes, role)


def _group_tensors(tensors: Any, n_layers: int) -> tuple[
        list[list[TensorInfo]], list[TensorInfo], TensorInfo | None, list[TensorInfo]]:
    """Split the directory: per-block tensors, lookup tables, output matrix, the rest."""
    blocks: list[list[TensorInfo]] = [[] for _ in range(n_layers)]
    lookups, others, output = [], [], None
    for t in tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
            blocks[int(parts[1])].append(t)
        elif t.name == "output.weight":
            output = t
        elif t.name.endswith("embd.weight") and len(t.shape) == 2:
            lookups.append(t)
        else:
            others.append(t)
    return blocks, lookups, output, others


def _is_recurrent(tensors: list[TensorInfo]) -> bool:
    """A block with a recurrent mixer: Mamba-2 / Gated DeltaNet (ssm_*) or LFM2's shortconv."""
    return any(t.name.split(".")[2].startswith(("ssm_", "shortconv")) for t in tensors)


def _gguf_state_elements(meta: Any, hidden: int) -> int:
    """fp32 values one sequence's state takes in one recurrent layer (config.RecurrentConfig
    in GGUF terms). LFM2: the conv's last l_cache - 1 inputs over `hidden` channels. Mamba-2
    and Gated DeltaNet share one layout: a conv over inner + 2 x groups x state_size channels
    (x, B, C; or q, k, v) and an SSM / delta-rule state of inner x state_size (H x P x N, or
    Hv x Dk x Dv with Dk = state_size and Hv x Dv = inner)."""
    if meta("shortconv.l_cache"):
        return (int(meta("shortconv.l_cache")) - 1) * hidden
    if not meta("ssm.conv_kernel"):
        return 0
    inner, n = int(meta("ssm.inner_size")), int(meta("ssm.state_size"))
    channels = inner + 2 * int(meta("ssm.group_count", 1)) * n
    return (int(meta("ssm.conv_kernel")) - 1) * channels + inner * n


def _gguf_layer(tensors: list[TensorInfo], shape: tuple[int, int, int, int],
                window: int | None, ffn_width: int, state_bytes: int = 0) -> LayerSpec:
    """One block from its tensors; `shape`: (kv_elements, attn_flop_per_key, heads, kv_heads)."""
    dense = [t for t in tensors if "_exps" not in t.name]
    routed = [t for t in tensors if "_exps" in t.name]
    return LayerSpec(
        dense_bytes=sum(t.nbytes for t in dense),
        dense_params=sum(_numel(t) for t in dense if len(t.shape) >= 2),
        expert_bytes=sum(t.nbytes for t in routed),
        expert_params=sum(_numel(t) for t in routed if len(t.shape) >= 2),
        kv_elements=shape[0], attn_flop_per_key=shape[1], window=window, heads=shape[2],
        kv_heads=shape[3], ffn_width=ffn_width, state_bytes=state_bytes,
        matrices=tuple(_matrix(t) for t in dense if len(t.shape) == 2))


def _attention_shapes(meta: Any, n_layers: int, hidden: int
                      ) -> list[tuple[int, int, int, int]]:
    """Per layer: (kv_heads x (key_dim + value_dim), 2 x heads x (key_dim + value_dim),
    heads, kv_heads)."""
    heads = _per_layer(meta("attention.head_count", 0), n_layers)
    kv_heads = _per_layer(meta("attention.head_count_kv", heads), n_layers)
    first_heads = next((h for h in heads if h), 1)
    key_dim = int(meta("attention.key_length", hidden // first_heads))
    value_dim = int(meta("attention.value_length", key_dim))
    width = key_dim + value_dim
    # latent attention caches one latent and its rotary key part per token, whatever the
    # heads (V is read from the latent)
    latent = int(meta("attention.kv_lora_rank", 0)) and (
        int(meta("attention.kv_lora_rank")) + int(meta("rope.dimension_count", 0)))
    # a layer without KV heads (the recurrent layers of a hybrid) does no attention
    return [(latent or kv * width, 2 * h * width if kv else 0, h, kv)
            for h, kv in zip(heads, kv_heads)]


def _gguf_windows(arch: str, meta: Any, n_layers: int) -> list[int | None]:
    window = _int_or_none(meta("attention.sliding_window"))
    if not window:
        return [None] * n_layers
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True = sliding
        return [window if bool(s) else None for s in _per_layer(pattern, n_layers)]
    every = int(pattern) if pattern else GLOBAL_EVERY.get(arch.removesuffix("_text"))
    if every is None:  # unknown layout: full attention is the safe (larger) KV figure
        return [None] * n_layers
    return layer_windows(n_layers, window, every)


def layer_windows(n_layers: int, window: int, global_every: int | None) -> list[int | None]:
    """Each layer's window by kvlab's one interleave rule (config.interleaved_layer_types)."""
    return _windows(interleaved_layer_types(n_layers, global_every), window)


def _windows(layer_types: tuple[str, ...], window: int) -> list[int | None]:
    return [window if t == "sliding" else None for t in layer_types]


# -- HF config.json -------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """A dense or MoE decoder as an HF config describes it (gated MLP: 3 matrices)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    windows: tuple[int | None, ...]
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0

    def attention_params(self) -> int:
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q_dim + 2 * self.hidden * kv_dim

    def dense_ffn_params(self) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate
        return 3 * self.hidden * self.shared_intermediate + self.hidden * self.experts  # router

    def expert_params(self) -> int:
        return self.experts * 3 * self.hidden * self.expert_intermediate

    def total_params(self) -> int:
        per_layer = self.attention_params() + self.dense_ffn_params() + self.expert_params()
        tables = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (per_layer + 2 * self.hidden) + tables + self.hidden


def architecture_from_config(c: ModelConfig) -> Architecture:
    """A loaded model's config in the same terms as an HF config.json gives them."""
    moe = c.moe
    return Architecture(
        layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate=c.intermediate_size, vocab=c.vocab_size,
        tied=c.tie_word_embeddings,
        windows=tuple(c.sliding_window if c.is_sliding(i) else None
                      for i in range(c.num_layers)),
        experts=moe.num_experts if moe else 0, experts_used=moe.experts_per_token if moe else 0,
        expert_intermediate=moe.expert_intermediate_size if moe else 0,
        shared_intermediate=moe.shared_intermediate_size if moe else 0)


def dense_architecture(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                       intermediate: int, vocab: int, tied: bool = False) -> Architecture:
    """A dense decoder with full attention in every layer (a public model's shape)."""
    return Architecture(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied,
                        windows=(None,) * layers)


def spec_from_architecture(arch: Architecture, bits: float, name: str) -> ModelSpec:
    """`arch` stored at `bits` per weight, as a description: its weights' bytes from the
    bits, its attention and MLP shapes as they are."""
    return spec_from_description(
        bits=bits, layers=arch.layers, hidden=arch.hidden, heads=arch.heads,
        kv_heads=arch.kv_heads, head_dim=arch.head_dim, vocab=arch.vocab,
        intermediate=arch.intermediate, tied=arch.tied, name=name)


def with_caches_of(spec: ModelSpec, model: ModelSpec) -> ModelSpec:
    """`spec`'s weights with `model`'s caches layer by layer (KV width, window, attention
    FLOP, recurrent state): the same model at another quantization keeps a hybrid's states
    and a latent instead of per-head K/V. Needs the same layer count."""
    if spec.n_layers != model.n_layers:
        raise KvlabError(f"{spec.name} has {spec.n_layers} layers and {model.name} "
                         f"{model.n_layers}: their caches do not line up")
    layers = tuple(replace(lyr, kv_elements=m.kv_elements, attn_flop_per_key=m.attn_flop_per_key,
                           window=m.window, kv_heads=m.kv_heads, state_bytes=m.state_bytes)
                   for lyr, m in zip(spec.layers, model.layers))
    return replace(spec, layers=layers)


def spec_from_hf_config(path: str | Path, bits: float | None = None) -> ModelSpec:
    p = Path(path).expanduser()
    cfg_path = p / "config.json" if p.is_dir() else p
    cfg = _read_json(cfg_path)
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrapper: the LM is inside
        cfg = {**cfg, **cfg["text_config"]}
    arch = _hf_architecture(cfg, cfg_path)
    bits = bits if bits is not None else _hf_bits(cfg, cfg_path)
    _check_bits(bits)
    bytes_per_param = bits / 8
    kinds, state = _hf_recurrent(cfg, arch.layers, arch.hidden)
    layers = tuple(_arch_layer(arch, w, bytes_per_param) if k in ("full", "sliding") else
                   replace(_arch_layer(arch, w, bytes_per_param), kv_elements=0,
                           attn_flop_per_key=0, kv_heads=0,
                           state_bytes=4 * state if k == "recurrent" else 0)
                   for w, k in zip(arch.windows, kinds))
    if cfg.get("kv_lora_rank"):  # latent attention: the latent and its rotary key part
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        layers = tuple(replace(lyr, kv_elements=latent) for lyr in layers)
    table = arch.vocab * arch.hidden
    n_params = arch.total_params()
    name = str(cfg.get("_name_or_path") or (cfg.get("architectures") or ["?"])[0])
    return ModelSpec(
        name=name, source="hf-config", n_params=n_params,
        weight_bytes=int(n_params * bytes_per_param), layers=layers, lookup_params=table,
        lookup_row_bytes=int(arch.hidden * bytes_per_param), output_params=table,
        output_bytes=int(table * bytes_per_param),
        other_bytes=int(arch.hidden * bytes_per_param), experts=arch.experts,
        experts_used=arch.experts_used,
        max_context=_int_or_none(cfg.get("max_position_embeddings")), vocab_size=arch.vocab,
        hidden_size=arch.hidden, tied_output=arch.tied,
        architecture=str(cfg.get("model_type") or ""))


def _hf_architecture(cfg: dict[str, Any], where: Path) -> Architecture:
    def need(key: str) -> int:
        return int(_required(cfg.get(key), key, str(where)))

    hidden, heads, n_layers = need("hidden_size"), need("num_attention_heads"), \
        need("num_hidden_layers")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    intermediate = need("intermediate_size")
    return Architecture(
        layers=n_layers, hidden=hidden, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=intermediate,
        vocab=need("vocab_size"), tied=bool(cfg.get("tie_word_embeddings", True)),
        windows=tuple(_hf_windows(cfg, n_layers)), experts=experts,
        experts_used=int(cfg.get("num_experts_per_tok") or 0),
        expert_intermediate=int(cfg.get("moe_intermediate_size") or intermediate),
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))


def _hf_recurrent(cfg: dict[str, Any], n_layers: int, hidden: int
                  ) -> tuple[tuple[str, ...], int]:
    """Each layer's kind (config.hf_layer_types: recurrent for LFM2 "conv", Qwen3.5
    "linear_attention", Granite 4 "mamba", Nemotron-H "M"; "mlp" for Nemotron-H's MLP-only
    layers, which keep neither KV nor a state) and the fp32 values one sequence's state
    takes in each recurrent layer (as `_gguf_state_elements`)."""
    types = (cfg.get("layer_types") or cfg.get("layers_block_type")
             or cfg.get("hybrid_override_pattern"))
    if not isinstance(types, list | str) or len(types) != n_layers:
        return ("full",) * n_layers, 0
    kinds = hf_layer_types(types)
    if "conv_L_cache" in cfg:  # LFM2
        return kinds, (int(cfg["conv_L_cache"]) - 1) * hidden
    if "linear_conv_kernel_dim" in cfg:  # Gated DeltaNet
        kernel, n = int(cfg["linear_conv_kernel_dim"]), int(cfg["linear_key_head_dim"])
        inner = int(cfg["linear_num_value_heads"]) * int(cfg["linear_value_head_dim"])
        groups = int(cfg["linear_num_key_heads"])
    elif "mamba_d_conv" in cfg:  # Mamba-2
        kernel, n = int(cfg["mamba_d_conv"]), int(cfg["mamba_d_state"])
        heads = int(cfg["mamba_n_heads"])
        head_dim = cfg.get("mamba_d_head")
        if not isinstance(head_dim, int):  # "auto"
            head_dim = cfg.get("mamba_expand", 2) * hidden // heads
        inner = heads * head_dim
        groups = int(cfg.get("mamba_n_groups", 1))
    elif "mamba_num_heads" in cfg:  # Nemotron-H's Mamba-2
        kernel, n = int(cfg.get("conv_kernel", 4)), int(cfg.get("ssm_state_size", 128))
        inner = int(cfg["mamba_num_heads"]) * int(cfg["mamba_head_dim"])
        groups = int(cfg.get("n_groups", 8))
    else:
        return kinds, 0
    return kinds, (kernel - 1) * (inner + 2 * groups * n) + inner * n


def _hf_windows(cfg: dict[str, Any], n_layers: int) -> list[int | None]:
    window = _int_or_none(cfg.get("sliding_window"))
    types = cfg.get("layer_types")
    if window and isinstance(types, list) and len(types) == n_layers:
        return _windows(hf_layer_types(types), window)
    if not window:
        return [None] * n_layers
    if cfg.get("sliding_window_pattern"):
        return layer_windows(n_layers, window, int(cfg["sliding_window_pattern"]))
    model_type = str(cfg.get("model_type", ""))
    if model_type.removesuffix("_text") in GLOBAL_EVERY:
        return layer_windows(n_layers, window, GLOBAL_EVERY[model_type.removesuffix("_text")])
    if model_type in ("mistral", "mixtral") or cfg.get("use_sliding_window"):
        return layer_windows(n_layers, window, None)
    return [None] * n_layers


def _arch_layer(arch: Architecture, window: int | None, bytes_per_param: float) -> LayerSpec:
    dense = arch.attention_params() + arch.dense_ffn_params()
    expert = arch.expert_params()
    width = 2 * arch.head_dim
    return LayerSpec(
        dense_bytes=int((dense + 2 * arch.hidden) * bytes_per_param), dense_params=dense,
        expert_bytes=int(expert * bytes_per_param), expert_params=expert,
        kv_elements=arch.kv_heads * width, attn_flop_per_key=2 * arch.heads * width,
        window=window, heads=arch.heads, kv_heads=arch.kv_heads,
        ffn_width=arch.intermediate if not arch.experts else 0)


def _hf_bits(cfg: dict[str, Any], where: Path) -> float:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("bits"):
        return float(quant["bits"])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    if dtype in HF_DTYPE_BITS:
        return float(HF_DTYPE_BITS[dtype])
    raise KvlabError(f"{where} does not say how weights are stored (dtype {dtype or 'missing'}); "
                     f"pass --bits (e.g. 16 for bf16, 4.5 for Q4_K_M)")


# -- description ----------------------------------------------------------------------------


def spec_from_description(
        params: float | None = None, bits: float | None = None, size_bytes: float | None = None,
        layers: int | None = None, hidden: int | None = None, heads: int | None = None,
        kv_heads: int | None = None, head_dim: int | None = None, vocab: int | None = None,
        intermediate: int | None = None, tied: bool = False, max_context: int | None = None,
        name: str | None = None) -> ModelSpec:
    """A model from what is known of it; unknown parts cost nothing (and are noted).

    `params` may be left out when layers, hidden, intermediate, vocab and heads are given.
    Bytes: `size_bytes`, or params x bits / 8. Without vocab and hidden, every parameter is
    a block parameter (2 FLOP per token, read every step): the rule of thumb.
    """
    _check_counts(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, vocab=vocab, intermediate=intermediate,
                   max_context=max_context)
    head_dim = head_dim or (hidden // heads if hidden and heads else None)
    kv_heads = kv_heads or heads
    n_params = _description_params(params, layers, hidden, heads, kv_heads, head_dim, vocab,
                                   intermediate, tied)
    weight_bytes = _description_bytes(n_params, bits, size_bytes)
    table = vocab * hidden if vocab and hidden else 0
    block_params = n_params - table - (0 if tied else table)
    if block_params <= 0:
        raise KvlabError(f"--params {n_params:.3g} is too small for vocab x hidden = {table:.3g}"
                         f" embedding{'' if tied else ' and output'} parameters")
    per_param = weight_bytes / n_params
    n = layers or 1
    kv_elements = 2 * kv_heads * head_dim if layers and kv_heads and head_dim else 0
    attn = 4 * heads * head_dim if heads and head_dim else 0
    layer = LayerSpec(dense_bytes=int(block_params / n * per_param),
                      dense_params=int(block_params / n), kv_elements=kv_elements,
                      attn_flop_per_key=attn, heads=heads or 0,
                      kv_heads=kv_heads if kv_elements else 0)
    label = name or f"{n_params / 1e9:.3g}B-param model, {weight_bytes / 1e9:.3g} GB"
    return ModelSpec(
        name=label, source="description", n_params=int(n_params),
        weight_bytes=int(weight_bytes), layers=(layer,) * n, lookup_params=table,
        lookup_row_bytes=int(hidden * per_param) if table else 0, output_params=table,
        output_bytes=int(table * per_param), max_context=max_context, vocab_size=vocab,
        hidden_size=hidden, layers_known=layers is not None, tied_output=tied and table > 0)


def _description_params(params: float | None, layers: int | None, hidden: int | None,
                        heads: int | None, kv_heads: int | None, head_dim: int | None,
                        vocab: int | None, intermediate: int | None, tied: bool) -> float:
    if params is not None:
        if not (math.isfinite(params) and params >= 1):
            raise KvlabError(f"--params must be a positive count such as 8e9, got {params!r}")
        return params
    if not all((layers, hidden, heads, vocab, intermediate)):
        raise KvlabError("describe the model with --params (e.g. 8e9), or with all of "
                         "--layers --hidden --heads --intermediate --vocab")
    assert layers and hidden and heads and kv_heads and head_dim and vocab and intermediate
    arch = Architecture(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied,
                        (None,) * layers)
    return float(arch.total_params())


def _description_bytes(n_params: float, bits: float | None, size_bytes: float | None) -> float:
    if size_bytes is not None:
        if not (math.isfinite(size_bytes) and size_bytes > 0):
            raise KvlabError(f"--size-gb must be positive, got {size_bytes / 1e9!r}")
        return size_bytes
    if bits is None:
        raise KvlabError("say how the weights are stored: --bits (e.g. 4.5 for Q4_K_M, 16 for "
                         "bf16) or --size-gb (the file size)")
    _check_bits(bits)
    return n_params * bits / 8


# -- small helpers ---------------------------------------------------------------------------


def _check_bits(bits: float) -> None:
    if not (math.isfinite(bits) and 1 <= bits <= 32):
        raise KvlabError(f"--bits must be between 1 and 32 bits per weight, got {bits!r}")


def _check_counts(**counts: int | None) -> None:
    for key, value in counts.items():
        if value is not None and value <= 0:
            flag = "--" + key.replace("_", "-")
            raise KvlabError(f"{flag} must be a positive integer, got {value}")


def _numel(t: TensorInfo) -> int:
    return int(np.prod(t.shape)) if t.shape else 1


def _per_layer(value: Any, n_layers: int) -> list[int]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(v) for v in value][:n_layers]
    return [int(value)] * n_layers


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def _required(value: Any, key: str, where: str) -> Any:
    if value is None:
        raise ModelLoadError(f"{where}: `{key}` is missing, cannot size the model")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found (expected a config.json or a directory "
                             "holding one)") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data
