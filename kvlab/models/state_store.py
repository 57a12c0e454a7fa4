"""The recurrent layers' per-sequence states: fixed-size fp32 tensors, one row per slot.

A hybrid model's recurrent layers (LFM2's short convolutions, Qwen3.5's Gated DeltaNet)
carry no KV; each sequence has one state per layer instead, of the same size however long
the sequence is. The runner owns them (RecurrentStates, allocated once with one row per
state slot of kvlab.cache.state_slots) and hands a step's view of them (StateBatch) to the
model as an argument, beside the KV caches:

    step tokens   [ a0 a1 a2 | b0 | c0 c1 ]      sequences are contiguous segments
    slots         [    3     |  0 |   5   ]      row of each segment's state
    lens          [    3     |  1 |   2   ]      tokens of each segment this step

The recurrent ops (kvlab.kernels.recurrent) read and update row slots[s] in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.config import ModelConfig


@dataclass(frozen=True)
class LayerState:
    """One recurrent layer's states, a row per slot."""

    conv: torch.Tensor  # [num_slots, K - 1, C] fp32: the convolution's last K - 1 inputs
    # [num_slots, Hv, Dk, Dv] fp32: Gated DeltaNet's state matrix per value head; None for
    # a short convolution, whose conv state is all it keeps
    recurrent: torch.Tensor | None = None


@dataclass(frozen=True)
class StateBatch:
    """A step's view of the states: the layers' tensors and each sequence's row in them."""

    layers: tuple[LayerState | None, ...]  # by layer index; None for attention layers
    slots: torch.Tensor  # [S] int64: row of each sequence, in batch order
    lens: torch.Tensor  # [S] int64: its tokens this step (contiguous, in batch order)


class RecurrentStates:
    """Every recurrent layer's states for `num_slots` sequences, zeroed at allocation."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device) -> None:
        rc = config.recurrent
        if rc is None:
            raise ValueError(f"{config.architecture} has no recurrent layers to keep states for")
        self.num_slots = num_slots
        rec = rc.recurrent_state_shape
        self.layers = tuple(
            LayerState(torch.zeros(num_slots, *rc.conv_state_shape, device=device),
                       None if rec is None else torch.zeros(num_slots, *rec, device=device))
            if config.is_recurrent(i) else None
            for i in range(config.num_layers))

    def zero(self, slots: list[int]) -> None:
        """Clear these rows: sequences that start from token 0 there."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long)
        for layer in self.layers:
            if layer is None:
                continue
            for t in (layer.conv, layer.recurrent):
                if t is not None:
                    t.index_fill_(0, index.to(t.device), 0.0)

    def copy(self, sources: list[int], targets: list[int]) -> None:
        """Row targets[i] becomes a copy of row sources[i] in every layer (a snapshot saved,
        or restored into a sequence's slot)."""
        if not sources:
            return
        src, dst = torch.tensor(sources, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
        for layer in self.layers:
            for t in (() if layer is None else (layer.conv, layer.recurrent)):
                if t is not None:
                    t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))

    def batch(self, slots: list[int], lens: list[int]) -> StateBatch:
        """The step's view: sequence s runs lens[s] tokens from its state in row slots[s]."""
        if any(not 0 <= s < self.num_slots for s in slots):
            raise IndexError(f"state slots {slots} outside [0, {self.num_slots})")
        device = next(t.conv.device for t in self.layers if t is not None)
        return StateBatch(self.layers, torch.tensor(slots, dtype=torch.long, device=device),
                          torch.tensor(lens, dtype=torch.long, device=device))
