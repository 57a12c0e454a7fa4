"""The decoder loop hybrid families share: recurrent layers beside attention layers.

Each layer mixes tokens with either its recurrent op (from its state) or attention (from the
KV cache), then runs its MLP, both pre-norm with a residual:

    h = norm(x);  x += recurrent(h, state) if the layer keeps a state else attention(h, kv)
    h = norm(x);  x += mlp(h)

A layer of kind "mlp" mixes no tokens: it is `x += mlp(norm(x))` alone, keeping neither KV
nor a state. Where the config's mlp_after_mixer is false (Nemotron-H), the attention and
recurrent layers run their mixer alone and such layers hold the MLPs.

A family file (lfm2.py, qwen3_5.py) subclasses HybridModel with its own `recurrent` and
`attention`, and with its own `mlp` where it differs from SwiGLU. Granite's multipliers
(ModelConfig.embedding_scale, residual_scale, logit_scale) apply here, 1 for the others.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvlab.config import ModelConfig
from kvlab.errors import ModelLoadError
from kvlab.models import decode_c, moe
from kvlab.models.attention import AttentionMetadata, KVStore
from kvlab.models.layers import RopeTable, Weight, embed, linear, rms_norm, rope_cos_sin, swiglu
from kvlab.models.sharding import SINGLE, TensorParallel
from kvlab.models.state_store import LayerState, StateBatch

log = logging.getLogger("kvlab.models")


def check_state_tensors(config: ModelConfig, i: int, layer: dict[str, Any],
                        expect: dict[str, tuple[int, ...]], kind: str, dims: str) -> None:
    """A recurrent layer `i` of `kind` holds every tensor of `expect` in its shape, the one
    its state dimensions (described by `dims`) give: a GGUF whose ssm.* keys disagree with
    its tensors fails here, naming the tensor."""
    missing = [n for n in expect if n not in layer]
    if missing:
        raise ModelLoadError(f"{config.architecture} layer {i} is a {kind} layer but lacks "
                             f"{', '.join(missing)}")
    for name, shape in expect.items():
        if tuple(layer[name].shape) != shape:
            raise ModelLoadError(
                f"{config.architecture} layer {i}: {name} is {list(layer[name].shape)}, but "
                f"the state dimensions say {list(shape)} ({dims})")


class HybridModel:
    """Weights (frozen after load) plus the forward pass; the KV caches and the recurrent
    states come in as arguments. `inv_freq` is set by the family (its RoPE)."""

    inv_freq: RopeTable  # cos/sin kept by position
    # decode steps' layers in one C call (decode_c), where the family builds a plan
    c_plan: decode_c.Plan | None = None

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 layers: list[dict[str, Any]], tp: TensorParallel = SINGLE) -> None:
        if tp.size > 1:
            raise ModelLoadError(f"{config.architecture} runs on one rank (no tensor parallel "
                                 "split of its recurrent layers); start without tensor parallel")
        self.config, self.weights, self.layers = config, weights, layers

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVStore | None], meta: AttentionMetadata,
                trace: list[torch.Tensor] | None = None, *,
                states: StateBatch) -> torch.Tensor:
        """ids, positions: [T] -> final hidden states [T, hidden] (before the final norm).
        `trace`: a list MoE layers append their chosen expert ids [T, k] to."""
        eps, r = self.config.rms_norm_eps, self.config.residual_scale
        x = embed(ids, self.weights["embed"])
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        rope = rope_cos_sin(positions, self.inv_freq)
        if self.c_plan is not None and trace is None and decode_c.run(
                self.c_plan, self.config, x, {False: rope, True: self._second_rope(rope)},
                kv_caches, meta, states=states):
            return x
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            h = rms_norm(x, layer["attn_norm"], eps)
            layer_state = states.layers[i]
            if self.config.layer_types[i] == "mlp":  # no mixer: the first norm feeds the MLP
                x.add_(self.mlp(h, layer, trace), alpha=r)
                continue
            if layer_state is not None:
                x.add_(self.recurrent(h, layer, layer_state, states), alpha=r)
            else:
                assert cache is not None
                x.add_(self.attention(h, layer, rope, cache, meta), alpha=r)
            if self.config.mlp_after_mixer:
                x.add_(self.mlp(rms_norm(x, layer["mlp_norm"], eps), layer, trace), alpha=r)
        return x

    def _second_rope(self, rope: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The C plan's second table: the identity rotation (cos 1, sin 0: exact) where the
        attention layers have no RoPE (Granite's "nope" checkpoints, Nemotron-H)."""
        if self.config.no_rope_layers:
            return torch.ones_like(rope[0]), torch.zeros_like(rope[1])
        return rope

    def recurrent(self, h: torch.Tensor, layer: dict[str, Any], state: LayerState,
                  states: StateBatch) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: the family's recurrent op, each sequence from its
        state's row states.slots[s], updated in place."""
        raise NotImplementedError

    def attention(self, h: torch.Tensor, layer: dict[str, Any],
                  rope: tuple[torch.Tensor, torch.Tensor], cache: KVStore,
                  meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, h: torch.Tensor, layer: dict[str, Any],
            trace: list[torch.Tensor] | None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: the routed experts where the layer has a router (the
        MoE variants after their dense layers), else SwiGLU."""
        if "router" not in layer:
            return self.swiglu_mlp(h, layer)
        assert self.config.moe is not None
        return moe.moe_mlp(h, layer, self.config.moe, trace)

    def swiglu_mlp(self, h: torch.Tensor, layer: dict[str, Any]) -> torch.Tensor:
        return linear(swiglu(linear(h, layer["gate_up"], transient=True)), layer["down"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32, through the tied embedding where there is no head."""
        h = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        logits = linear(h, self.weights.get("lm_head", self.weights["embed"])).float()
        return logits if self.config.logit_scale == 1.0 else logits / self.config.logit_scale
