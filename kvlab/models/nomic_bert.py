"""nomic-bert (nomic-embed-text): BERT's post-norm encoder with rotary positions in place of
learned ones (rotate-half, over the whole head), a SwiGLU MLP, q|k|v stored as one matrix,
and no biases in its products (the LayerNorms keep theirs).

What differs from bert.py is only that: the embeddings skip the position table, q and k
are rotated by position before attention, and the MLP is silu(gate) * up (HF's fc12 is the
gate, fc11 the up projection, as llama.cpp's converter maps them). Loaded from HF
(`NomicBertModel`) or llama.cpp's `nomic-bert` GGUF; mean pooling unless the file says.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.config import ModelConfig, RopeConfig
from kvlab.errors import ModelLoadError
from kvlab.models.bert import BertModel, encoder_config, layer_linear
from kvlab.models.layers import Weight, apply_rope, embed, rope_cos_sin, rope_inv_freq, swiglu
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

GGUF_NAMES = NameTable(
    globals={"token_embd.weight": "embed", "token_types.weight": "type_embed",
             "token_embd_norm.weight": "embed_norm", "token_embd_norm.bias": "embed_norm_bias"},
    layer_prefix="blk.{i}.",
    layer={"attn_qkv.weight": "qkv", "attn_output.weight": "o", "ffn_up.weight": "up",
           "ffn_gate.weight": "gate", "ffn_down.weight": "down",
           "attn_output_norm.weight": "attn_norm", "attn_output_norm.bias": "attn_norm_bias",
           "layer_output_norm.weight": "mlp_norm", "layer_output_norm.bias": "mlp_norm_bias"},
)
HF_NAMES = NameTable(
    globals={"embeddings.word_embeddings.weight": "embed",
             "embeddings.token_type_embeddings.weight": "type_embed",
             "emb_ln.weight": "embed_norm", "emb_ln.bias": "embed_norm_bias"},
    layer_prefix="encoder.layers.{i}.",
    layer={"attn.Wqkv.weight": "qkv", "attn.out_proj.weight": "o", "mlp.fc11.weight": "up",
           "mlp.fc12.weight": "gate", "mlp.fc2.weight": "down", "norm1.weight": "attn_norm",
           "norm1.bias": "attn_norm_bias", "norm2.weight": "mlp_norm",
           "norm2.bias": "mlp_norm_bias"},
)
# HF config fields that must hold these values: other settings change the math
_HF_FIXED = {"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
             "activation_function": "swiglu", "prenorm": False, "qkv_proj_bias": False,
             "mlp_fc1_bias": False, "mlp_fc2_bias": False}


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "nomic-bert")
    return encoder_config(
        "nomic-bert", vocab=int(g("vocab_size", None) or len(meta["tokenizer.ggml.tokens"])),
        hidden=int(g("embedding_length")), layers=int(g("block_count")),
        heads=int(g("attention.head_count")), inter=int(g("feed_forward_length")),
        context=int(g("context_length")), eps=float(g("attention.layer_norm_epsilon", 1e-12)),
        name=str(meta.get("general.name", "nomic-bert")),
        rope=RopeConfig(theta=float(g("rope.freq_base", 1000.0))))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    wrong = {k: cfg[k] for k, v in _HF_FIXED.items() if k in cfg and cfg[k] != v}
    if wrong:
        raise ModelLoadError(f"nomic-bert settings {wrong} are not supported (valid: "
                             f"{ {k: _HF_FIXED[k] for k in wrong} })")
    hidden = cfg["n_embd"]
    return encoder_config(
        "nomic-bert", vocab=cfg["vocab_size"], hidden=hidden, layers=cfg["n_layer"],
        heads=cfg["n_head"], inter=cfg.get("n_inner") or 4 * hidden,
        context=cfg.get("n_positions", 2048), eps=cfg.get("layer_norm_epsilon", 1e-12),
        name=cfg.get("_name_or_path", "nomic-bert"),
        rope=RopeConfig(theta=float(cfg.get("rotary_emb_base", 1000.0))))


class NomicBertModel(BertModel):
    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, weights, layers, tp)
        device = weights["embed_norm"].device
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim).to(device)

    def embeddings(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return embed(ids, self.weights["embed"])  # positions are rotated in, not added

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def mlp(self, x: torch.Tensor, layer: dict[str, Any]) -> torch.Tensor:
        return layer_linear(swiglu(layer_linear(x, layer, "gate_up")), layer, "down")


SPEC = ArchSpec(
    name="nomic-bert", model_cls=NomicBertModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("NomicBertModel",), pooling="mean",
    fused_sizes=lambda c: {"qkv": (c.hidden_size,) * 3})
