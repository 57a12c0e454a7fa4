"""BERT: an encoder for embeddings. Bidirectional attention, learned absolute position and
token-type embeddings, post-LayerNorm (after each residual add), GELU MLP, biases throughout.

What differs from the decoders: every token attends to every token of its own sequence (no
mask, no KV cache: the whole input runs at once), positions are looked up rather than
rotated, and the norms are LayerNorms with a bias, applied after the residual add. The
model's output is the final hidden states, for kvlab.models.pooling; it has no LM head.
Loaded from HF (`BertModel` safetensors) or from llama.cpp's `bert` GGUF.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models.layers import Weight, embed, linear, split
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.spec import ArchSpec, NameTable, gguf_get

_LAYER_NAMES = {  # kvlab name -> (GGUF name, HF name), each with .weight and .bias
    "q": ("attn_q", "attention.self.query"), "k": ("attn_k", "attention.self.key"),
    "v": ("attn_v", "attention.self.value"), "o": ("attn_output", "attention.output.dense"),
    "attn_norm": ("attn_output_norm", "attention.output.LayerNorm"),
    "up": ("ffn_up", "intermediate.dense"), "down": ("ffn_down", "output.dense"),
    "mlp_norm": ("layer_output_norm", "output.LayerNorm"),
}
_GLOBAL_NAMES = {
    "embed": ("token_embd", "embeddings.word_embeddings"),
    "pos_embed": ("position_embd", "embeddings.position_embeddings"),
    "type_embed": ("token_types", "embeddings.token_type_embeddings"),
    "embed_norm": ("token_embd_norm", "embeddings.LayerNorm"),
}


def _table(fmt: int, names: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Checkpoint name -> kvlab name for weights ("q") and biases ("q_bias")."""
    out = {}
    for dst, srcs in names.items():
        out[f"{srcs[fmt]}.weight"] = dst
        out[f"{srcs[fmt]}.bias"] = f"{dst}_bias"
    return out


GGUF_NAMES = NameTable(globals=_table(0, _GLOBAL_NAMES), layer_prefix="blk.{i}.",
                       layer=_table(0, _LAYER_NAMES))
HF_NAMES = NameTable(globals=_table(1, _GLOBAL_NAMES), layer_prefix="encoder.layer.{i}.",
                     layer=_table(1, _LAYER_NAMES))


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    g = gguf_get(meta, "bert")
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    return encoder_config(
        "bert", vocab=int(g("vocab_size", None) or len(meta["tokenizer.ggml.tokens"])),
        hidden=hidden, layers=int(g("block_count")), heads=heads,
        inter=int(g("feed_forward_length")), context=int(g("context_length")),
        eps=float(g("attention.layer_norm_epsilon", 1e-12)),
        name=str(meta.get("general.name", "bert")))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ModelLoadError(f"BERT hidden_act {act!r} is not supported (valid: gelu)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError("BERT position_embedding_type "
                             f"{cfg['position_embedding_type']!r} is not supported "
                             "(valid: absolute)")
    return encoder_config(
        "bert", vocab=cfg["vocab_size"], hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
        inter=cfg["intermediate_size"], context=cfg.get("max_position_embeddings", 512),
        eps=cfg.get("layer_norm_eps", 1e-12), name=cfg.get("_name_or_path", "bert"))


def layer_linear(x: torch.Tensor, layer: dict[str, Any], name: str) -> torch.Tensor:
    """The product with its bias where the checkpoint has one; fp32 (the norms' dtype)."""
    return linear(x, layer[name], layer.get(f"{name}_bias")).float()


def encoder_config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, inter: int,
                   context: int, eps: float, name: str, **more: Any) -> ModelConfig:
    """An encoder's shape: as many KV heads as heads, bidirectional, no LM head."""
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=inter, max_position_embeddings=context,
        rms_norm_eps=eps,  # the LayerNorms' epsilon
        tie_word_embeddings=True, causal=False, name=name, **more)


class BertModel:
    """Weights (frozen after load) plus the forward pass."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Weight]], tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ModelLoadError("BERT runs on one rank; start without tensor parallel")
        self.config, self.weights, self.layers = config, weights, layers

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """ids, positions: [T] of sequences packed back to back (`lengths` tokens each)
        -> final hidden states [T, hidden]. Every input is token type 0 (one segment)."""
        w = self.weights
        x = self.embeddings(ids, positions) + embed(torch.zeros_like(ids[:1]), w["type_embed"])
        x = self._norm(x, "embed_norm", w)
        for layer in self.layers:
            x = self._norm(x + self.attention(x, positions, layer, lengths), "attn_norm", layer)
            x = self._norm(x + self.mlp(x, layer), "mlp_norm", layer)
        return x

    def embeddings(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token plus learned absolute position embeddings [T, hidden]."""
        return embed(ids, self.weights["embed"]) + embed(positions, self.weights["pos_embed"])

    def mlp(self, x: torch.Tensor, layer: dict[str, Any]) -> torch.Tensor:
        h = F.gelu(layer_linear(x, layer, "up"))
        return layer_linear(h, layer, "down")

    def attention(self, x: torch.Tensor, positions: torch.Tensor, layer: dict[str, Any],
                  lengths: list[int]) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: each sequence attends over all of its own tokens."""
        c = self.config
        qkv = layer_linear(x, layer, "qkv")
        q, k, v = (t.reshape(-1, heads, c.head_dim) for t, heads in zip(
            split(qkv, layer["qkv"]), (c.num_heads, c.num_kv_heads, c.num_kv_heads)))
        q, k = self.rotate(q, k, positions)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, T, head_dim]
        out = torch.cat([  # per sequence, back to [n, hidden]
            F.scaled_dot_product_attention(qs, ks, vs, scale=c.scale).transpose(0, 1)
            .reshape(-1, c.hidden_size)
            for qs, ks, vs in zip(*(t.split(lengths, dim=1) for t in (q, k, v)))])
        return layer_linear(out, layer, "o")

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Position enters through the embeddings here: q and k go on unrotated."""
        return q, k

    def _norm(self, x: torch.Tensor, name: str, weights: dict[str, Any]) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], weights[name], weights[f"{name}_bias"],
                            self.config.rms_norm_eps)


SPEC = ArchSpec(
    name="bert", model_cls=BertModel, config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
    hf_architectures=("BertModel",), gated_mlp=False, pooling="cls")
