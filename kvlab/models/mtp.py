"""Multi-token-prediction (MTP, "nextn") layers: the extra layer DeepSeek-V3, GLM-4.5 and
Qwen3.5 checkpoints ship after their main layers, its checkpoint names, and one step of it.

An MTP layer guesses the token after next. Its row at position p takes the token x_p and
the main model's hidden state at p - 1, as the main model's final norm leaves it (the
state its output head reads; llama.cpp's h_nextn, vLLM's model output), and runs

    h'_p   = block( eh_proj( [ enorm(embed(x_p)) | hnorm(h_{p-1}) ] ) )
    out_p  = head_norm(h'_p)                 a guess of the hidden state at p
    logits = head(out_p)                     -> a guess of x_{p+1}

`block` is one decoder layer of the family (attention over its own KV of the positions the
layer has seen, then its MLP or experts); in a hybrid family (Qwen3.5) it is one of its
full-attention layers (gated attention), so the layer keeps K/V and no recurrent state.
The embedding comes first in the concatenation: DeepSeek-V3's report writes
[hnorm(h); enorm(e)], but its released eh_proj (and GLM-4.5's, Qwen3.5's fc) is laid out
[e | h], which is how llama.cpp, vLLM and SGLang run it. head_norm is the
layer's shared_head.norm and head its shared_head.head, the main model's final norm and
output head where the checkpoint has none (llama.cpp's fallback); likewise its own
embed_tokens or the main embedding. Guessing further runs the layer on its own output:
out_p stands in for h_p at the next row (llama.cpp's draft loop).

Checkpoint names: GGUF `blk.{N}.nextn.*` (llama.cpp's converter), HF `model.layers.{N}.*`
(eh_proj, enorm, hnorm, shared_head.*, embed_tokens); the block's own tensors carry the
family's ordinary layer names at index N = num_layers. A family that stores the layer apart
in its HF checkpoints names it in ArchSpec.hf_mtp_names (Qwen3.5: `mtp.fc` = eh_proj,
`mtp.pre_fc_norm_embedding` = enorm, `mtp.pre_fc_norm_hidden` = hnorm, `mtp.norm` =
head_norm, `mtp.layers.0.*` the block; llama.cpp's converter writes these as the nextn
layer N above). Only the first MTP layer is run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models.attention import AttentionMetadata, KVStore
from kvlab.models.hybrid import HybridModel
from kvlab.models.layers import Weight, embed, linear, rms_norm, rope_cos_sin
from kvlab.models.sharding import SINGLE
from kvlab.models.spec import NameTable

# the MTP layer's own tensors, past the family's layer prefix -> kvlab names
GGUF_NEXTN = {"nextn.eh_proj.weight": "eh_proj", "nextn.enorm.weight": "enorm",
              "nextn.hnorm.weight": "hnorm", "nextn.shared_head_norm.weight": "head_norm",
              "nextn.shared_head_head.weight": "head", "nextn.embed_tokens.weight": "embed"}
HF_NEXTN = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
            "shared_head.norm.weight": "head_norm", "shared_head.head.weight": "head",
            "embed_tokens.weight": "embed"}
_OWN = set(GGUF_NEXTN.values())
# its own tensors, and its block's that every MTP family has (q/k/v come stacked or not)
_REQUIRED = ("eh_proj", "enorm", "hnorm", "attn_norm", "o", "mlp_norm")
# architectures whose checkpoints may carry MTP layers that kvlab runs
FAMILIES = {"glm4moe": "GLM-4.5 / GLM-4.6", "deepseek2": "DeepSeek-V3", "qwen35": "Qwen3.5",
            "qwen35moe": "Qwen3.5-MoE"}


def mtp_table(table: NameTable, gguf: bool, hf_mtp: NameTable | None) -> NameTable:
    """The names of the MTP layer's tensors (layer_prefix formatted with i = num_layers):
    the family's own table for HF checkpoints that store it apart (hf_mtp), else the main
    layers' names at index num_layers beside GGUF_NEXTN / HF_NEXTN."""
    if hf_mtp is not None and not gguf:
        return hf_mtp
    return NameTable({}, table.layer_prefix, {**table.layer, **(GGUF_NEXTN if gguf else HF_NEXTN)},
                     table.experts)


def has_mtp(table: NameTable, i: int, names: set[str]) -> bool:
    """Whether the checkpoint holds any of the MTP layer's own tensors (mtp_table's, at i)."""
    prefix = table.layer_prefix.format(i=i)
    return any(prefix + src in names for src, dst in table.layer.items() if dst in _OWN)


@dataclass(frozen=True)
class Block:
    """The MTP layer's decoder layer, run through its family's model class (a LlamaModel
    and its MoE / latent-attention subclasses): attention, then the MLP or experts."""

    model: Any  # the family's model class over this one layer (model.layers[0])

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def layer(self) -> dict[str, Any]:
        return self.model.layers[0]

    def attention(self, h: torch.Tensor, positions: torch.Tensor, cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        cos, sin = (t.to(m.rope_dtype) for t in rope_cos_sin(positions, m.inv_freq))
        return m.attention(h, self.layer, cos, sin, cache, meta, False)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.mlp(h, self.layer)


class HybridBlock(Block):
    """The decoder layer of a hybrid family (kvlab.models.hybrid): one of its attention
    layers (Qwen3.5's gated attention), whose methods take RoPE as one pair."""

    def attention(self, h: torch.Tensor, positions: torch.Tensor, cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        return m.attention(h, self.layer, rope_cos_sin(positions, m.inv_freq), cache, meta)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.mlp(h, self.layer, None)


@dataclass(frozen=True)
class MtpLayer:
    """One MTP layer's weights (frozen after load); its KV store comes in as an argument."""

    block: Block
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Weight
    head_norm: torch.Tensor
    head: Weight
    embed: Weight
    main_norm: torch.Tensor  # the main model's final norm: its hidden states come through it
    eps: float

    @property
    def config(self) -> ModelConfig:
        """The block's config: one full-attention layer of the family's shape."""
        return self.block.config

    def main_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The main model's hidden states [N, hidden] (before its final norm, as its
        forward returns them) -> the states an MTP row takes in."""
        return rms_norm(hidden, self.main_norm, self.eps)

    def forward(self, ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                cache: KVStore, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (x_p, h_{p-1}) at positions p: ids [N], prev [N, hidden] -> out [M, hidden]
        for the rows `out_rows` picks (None: all). Every row's K/V is written to `cache`;
        rows that are not picked skip the MLP (their output is not needed)."""
        b, eps = self.block, self.eps
        e = rms_norm(embed(ids, self.embed), self.enorm, eps)
        h = rms_norm(prev.to(e.dtype), self.hnorm, eps)
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)
        x = x + b.attention(rms_norm(x, b.layer["attn_norm"], eps), positions, cache, meta)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        if not len(x):
            return x
        x = x + b.mlp(rms_norm(x, b.layer["mlp_norm"], eps))
        return rms_norm(x, self.head_norm, eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[M, hidden] (forward's output) -> [M, vocab] fp32."""
        return linear(out, self.head).float()


def build_mtp(model_cls: type, config: ModelConfig, weights: dict[str, Weight],
              layer: dict[str, Any]) -> MtpLayer:
    """The MTP layer from its loaded tensors (mtp_table's; the block's stacked as a main
    layer's are) and the main model's global weights."""
    missing = [n for n in _REQUIRED if n not in layer]
    if missing:
        raise ModelLoadError(f"the multi-token-prediction layer (layer {config.num_layers}) "
                             f"lacks {', '.join(missing)}: the checkpoint holds only part "
                             "of it")
    own = {k: layer[k] for k in _OWN if k in layer}
    block_layer = {k: v for k, v in layer.items() if k not in own}
    one = dataclasses.replace(config, num_layers=1, layer_types=("full",), kv_sources=(),
                              no_rope_layers=())
    block_cls = HybridBlock if issubclass(model_cls, HybridModel) else Block
    block = block_cls(model_cls(one, weights, [block_layer], SINGLE))
    head = own.get("head", weights.get("lm_head", weights["embed"]))
    return MtpLayer(block, own["enorm"], own["hnorm"], own["eh_proj"],
                    own.get("head_norm", weights["norm"]), head,
                    own.get("embed", weights["embed"]), weights["norm"], config.rms_norm_eps)
