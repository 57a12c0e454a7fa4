"""Multi-token-prediction (MTP, "nextn") layers: the extra layer DeepSeek-V3 and GLM-4.5
checkpoints ship after their main layers, its checkpoint names, and one step of it.

An MTP layer guesses the token after next. Its row at position p takes the token x_p and
the main model's hidden state at p - 1, as the main model's final norm leaves it (the
state its output head reads; llama.cpp's h_nextn, vLLM's model output), and runs

    h'_p   = block( eh_proj( [ enorm(embed(x_p)) | hnorm(h_{p-1}) ] ) )
    out_p  = head_norm(h'_p)                 a guess of the hidden state at p
    logits = head(out_p)                     -> a guess of x_{p+1}

`block` is one decoder layer of the family (attention over its own KV of the positions the
layer has seen, then its MLP or experts). The embedding comes first in the concatenation:
DeepSeek-V3's report writes [hnorm(h); enorm(e)], but its released eh_proj (and GLM-4.5's)
is laid out [e | h], which is how llama.cpp, vLLM and SGLang run it. head_norm is the
layer's shared_head.norm and head its shared_head.head, the main model's final norm and
output head where the checkpoint has none (llama.cpp's fallback); likewise its own
embed_tokens or the main embedding. Guessing further runs the layer on its own output:
out_p stands in for h_p at the next row (llama.cpp's draft loop).

Checkpoint names: GGUF `blk.{N}.nextn.*` (llama.cpp's converter), HF `model.layers.{N}.*`
(eh_proj, enorm, hnorm, shared_head.*, embed_tokens); the block's own tensors carry the
family's ordinary layer names at index N = num_layers. Only the first MTP layer is run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models.attention import AttentionMetadata, KVStore
from kvlab.models.layers import Weight, embed, linear, rms_norm, rope_cos_sin
from kvlab.models.sharding import SINGLE

# the MTP layer's own tensors, past the family's layer prefix -> kvlab names
GGUF_NEXTN = {"nextn.eh_proj.weight": "eh_proj", "nextn.enorm.weight": "enorm",
              "nextn.hnorm.weight": "hnorm", "nextn.shared_head_norm.weight": "head_norm",
              "nextn.shared_head_head.weight": "head", "nextn.embed_tokens.weight": "embed"}
HF_NEXTN = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
            "shared_head.norm.weight": "head_norm", "shared_head.head.weight": "head",
            "embed_tokens.weight": "embed"}
# its own tensors, and its block's that every MTP family has (q/k/v come stacked or not)
_REQUIRED = ("eh_proj", "enorm", "hnorm", "attn_norm", "o", "mlp_norm")
# architectures whose checkpoints may carry MTP layers that kvlab runs (a hybrid's, Qwen3.5's,
# would need its recurrent state to take back rejected guesses)
FAMILIES = {"glm4moe": "GLM-4.5 / GLM-4.6", "deepseek2": "DeepSeek-V3"}


def nextn_names(gguf: bool) -> dict[str, str]:
    return GGUF_NEXTN if gguf else HF_NEXTN


@dataclass(frozen=True)
class MtpLayer:
    """One MTP layer's weights (frozen after load); its KV store comes in as an argument."""

    block: Any  # the family's model class over this one decoder layer (block.layers[0])
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
        layer = b.layers[0]
        e = rms_norm(embed(ids, self.embed), self.enorm, eps)
        h = rms_norm(prev.to(e.dtype), self.hnorm, eps)
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)
        cos, sin = (t.to(b.rope_dtype) for t in rope_cos_sin(positions, b.inv_freq))
        x = x + b.attention(rms_norm(x, layer["attn_norm"], eps), layer, cos, sin, cache, meta,
                            False)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        if not len(x):
            return x
        x = x + b.mlp(rms_norm(x, layer["mlp_norm"], eps), layer)
        return rms_norm(x, self.head_norm, eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[M, hidden] (forward's output) -> [M, vocab] fp32."""
        return linear(out, self.head).float()


def build_mtp(model_cls: type, config: ModelConfig, weights: dict[str, Weight],
              layer: dict[str, Any]) -> MtpLayer:
    """The MTP layer from its loaded tensors (the block's stacked as a main layer's are,
    plus the GGUF_NEXTN / HF_NEXTN ones) and the main model's global weights."""
    missing = [n for n in _REQUIRED if n not in layer]
    if missing:
        raise ModelLoadError(f"the multi-token-prediction layer (layer {config.num_layers}) "
                             f"lacks {', '.join(missing)}: the checkpoint holds only part "
                             "of it")
    own = {k: layer[k] for k in set(GGUF_NEXTN.values()) if k in layer}
    block_layer = {k: v for k, v in layer.items() if k not in own}
    one = dataclasses.replace(config, num_layers=1, layer_types=("full",), kv_sources=(),
                              no_rope_layers=())
    block = model_cls(one, weights, [block_layer], SINGLE)
    head = own.get("head", weights.get("lm_head", weights["embed"]))
    return MtpLayer(block, own["enorm"], own["hnorm"], own["eh_proj"],
                    own.get("head_norm", weights["norm"]), head,
                    own.get("embed", weights["embed"]), weights["norm"], config.rms_norm_eps)
