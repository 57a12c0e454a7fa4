"""Decode steps as replayed CUDA graphs: one captured step per (batch, key-width) bucket.

A decode step of a large model launches hundreds of small kernels; on a GPU, Python and
launch overhead alone would take longer than reading the weights. So the runner captures the
whole decode pass (embedding to logits) once per bucket into a CUDA graph over static input
buffers; each step copies its ids, positions and slots into the buffers and replays.

Shapes are fixed per bucket:
    batch B: 1, 2, 4, 8, ...   rows past the real batch are padding
    width W: 256, 512, ...     keys attended per row; keys past a row's length are masked
Padding rows write their K/V to a scratch slot outside the block pool and attend to it
alone, so they never touch a real sequence's cache.

With capture off ("eager"), the same static path runs without a graph: the CPU tests check
it against the ordinary path that way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlab.config import ModelConfig
from kvlab.models.attention import AttentionGroup, AttentionMetadata, KVStore
from kvlab.scheduler import SchedulerOutput

MIN_WIDTH = 256
GRAPH_MODES = ("auto", "off", "eager")  # auto: capture on CUDA, off elsewhere


@dataclass
class _Bucket:
    """Static inputs of one (batch, width) shape, and its graph once captured."""

    ids: torch.Tensor  # [B] token ids
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B] where each row's new K/V goes
    slots: torch.Tensor  # [B, W] slot of every attended key
    lengths: torch.Tensor  # [B] keys each row sees: its first lengths[b] slots
    logits: torch.Tensor | None = None  # [B, vocab] the graph's output
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def batch(self) -> int:
        return self.ids.shape[0]


class DecodeGraphs:
    def __init__(self, model: object, config: ModelConfig, kv_caches: list[KVStore],
                 scratch_slot: int, device: torch.device, max_batch: int, max_width: int,
                 capture: bool) -> None:
        self.model, self.config, self.kv_caches = model, config, kv_caches
        self.scratch_slot, self.device = scratch_slot, device
        self.max_batch, self.max_width = max_batch, max_width
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.buckets: dict[tuple[int, int], _Bucket] = {}

    def accepts(self, out: SchedulerOutput) -> bool:
        """Pure decode steps (one new token per sequence, each needing logits) that fit."""
        return (0 < len(out.scheduled) <= self.max_batch
                and all(len(s.token_ids) == 1 and s.needs_logits for s in out.scheduled)
                and max(s.start for s in out.scheduled) < self.max_width)

    def run(self, out: SchedulerOutput,
            slots_of: Callable[[list[int], int], torch.Tensor]) -> torch.Tensor:
        """Logits [len(out.scheduled), vocab] fp32, rows in scheduled order."""
        n = len(out.scheduled)
        key = (_round_up_pow2(n, 1), _round_up_pow2(max(s.start for s in out.scheduled) + 1,
                                                    MIN_WIDTH, self.max_width))
        with torch.inference_mode():
            bucket = self.buckets.get(key) or self._new_bucket(*key)
            self._fill(bucket, out, slots_of)
            if bucket.graph is None:
                return self._forward(bucket)[:n]
            bucket.graph.replay()
            assert bucket.logits is not None
            return bucket.logits[:n].clone()  # the next replay overwrites the buffer

    def _new_bucket(self, batch: int, width: int) -> _Bucket:
        long = {"dtype": torch.long, "device": self.device}
        bucket = _Bucket(ids=torch.zeros(batch, **long), positions=torch.zeros(batch, **long),
                         slot_mapping=torch.full((batch,), self.scratch_slot, **long),
                         slots=torch.full((batch, width), self.scratch_slot, **long),
                         lengths=torch.ones(batch, **long))
        if self.capture:
            try:
                self._capture(bucket)
            except RuntimeError as e:  # a graph-unsafe op: keep serving, say why it is slower
                warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {e}",
                              stacklevel=2)
                self.capture = False
        self.buckets[(batch, width)] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (allocator, library handles), then record one step. The
        buffers hold padding rows only, so warm-up writes touch the scratch slot alone."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.logits = self._forward(bucket)
        bucket.graph = graph

    def _fill(self, bucket: _Bucket, out: SchedulerOutput,
              slots_of: Callable[[list[int], int], torch.Tensor]) -> None:
        """Copy this step's rows into the bucket's buffers; padding rows point at scratch."""
        batch, width = bucket.slots.shape
        ids = torch.zeros(batch, dtype=torch.long)
        positions = torch.zeros(batch, dtype=torch.long)
        lengths = torch.ones(batch, dtype=torch.long)
        slots = torch.full((batch, width), self.scratch_slot, dtype=torch.long)
        for b, s in enumerate(out.scheduled):
            end = s.start + 1
            seq_slots = slots_of(s.block_table, end)
            ids[b], positions[b], lengths[b] = s.token_ids[0], s.start, end
            slots[b, :end] = seq_slots
            slots[b, end:] = seq_slots[0]  # masked, but a written slot: never NaN
        bucket.ids.copy_(ids)
        bucket.positions.copy_(positions)
        bucket.lengths.copy_(lengths)
        bucket.slots.copy_(slots)
        bucket.slot_mapping.copy_(slots.gather(1, (lengths - 1)[:, None]).squeeze(1))

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The decode pass over the bucket's buffers; masks are computed in the graph."""
        batch, width = bucket.slots.shape
        keys = torch.arange(width, device=self.device)[None, :]
        seen = bucket.lengths[:, None]
        full = keys < seen
        rows = torch.arange(batch, device=self.device)
        groups_full = (AttentionGroup(rows, bucket.slots, full[:, None], batch, 1),)
        groups_sliding = groups_full
        if self.config.sliding_window:
            sliding = full & (keys >= seen - self.config.sliding_window)
            groups_sliding = (AttentionGroup(rows, bucket.slots, sliding[:, None], batch, 1),)
        meta = AttentionMetadata(bucket.slot_mapping, groups_full, groups_sliding)
        hidden = self.model.forward(bucket.ids, bucket.positions, self.kv_caches, meta)
        return self.model.logits(hidden)


def _round_up_pow2(n: int, low: int, high: int | None = None) -> int:
    size = low
    while size < n:
        size *= 2
    return size if high is None else min(size, high)
