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

import torch

from kvlab.config import ModelConfig
from kvlab.models.attention import AttentionGroup, AttentionMetadata, KVStore
from kvlab.scheduler import SchedulerOutput

MIN_WIDTH = 256
GRAPH_MODES = ("auto", "off", "eager")  # auto: capture on CUDA, off elsewhere


class _Bucket:
    """Static inputs of one (batch, width) shape, and its graph once captured.

    The inputs are columns of one packed [B, 4 + W] tensor, so a step uploads them in a
    single host-to-device copy (from pinned memory on CUDA):
        ids | positions | lengths | slot_mapping | slots[W]
    """

    def __init__(self, batch: int, width: int, scratch_slot: int, device: torch.device):
        self.staging = torch.empty(batch, 4 + width, dtype=torch.long)
        if device.type == "cuda":
            self.staging = self.staging.pin_memory()
        self.packed = torch.empty(batch, 4 + width, dtype=torch.long, device=device)
        pad_rows(self.staging, 0, scratch_slot)
        self.packed.copy_(self.staging)
        self.uploaded: torch.cuda.Event | None = None  # the last upload out of `staging`
        self.logits: torch.Tensor | None = None  # [B, vocab] the graph's output
        self.graph: torch.cuda.CUDAGraph | None = None

    ids = property(lambda self: self.packed[:, 0])  # [B] token ids
    positions = property(lambda self: self.packed[:, 1])  # [B]
    lengths = property(lambda self: self.packed[:, 2])  # [B] keys row b sees
    slot_mapping = property(lambda self: self.packed[:, 3])  # [B] where new K/V go
    slots = property(lambda self: self.packed[:, 4:])  # [B, W] slot of every attended key


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
        """Pure decode steps (one new token per sequence, each needing logits) that fit, over
        one block pool (the buffers hold one slot mapping)."""
        return (0 < len(out.scheduled) <= self.max_batch
                and all(len(s.token_ids) == 1 and s.needs_logits and s.window_table is None
                        for s in out.scheduled)
                and max(s.start for s in out.scheduled) < self.max_width)

    def run(self, out: SchedulerOutput, block_size: int, tables: torch.Tensor,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(out.scheduled), vocab] fp32, rows in scheduled order. tables: [n, >= 1]
        int64 CPU, each sequence's block table in its row (entries past its end are never
        read; the runner's persistent batch keeps them). input_ids: [n] on the device, the
        token ids in place of the ScheduledSeqs' (a step scheduled ahead)."""
        n = len(out.scheduled)
        key = (_round_up_pow2(n, 1), _round_up_pow2(max(s.start for s in out.scheduled) + 1,
                                                    MIN_WIDTH, self.max_width))
        with torch.inference_mode():
            bucket = self.buckets.get(key) or self._new_bucket(*key)
            self._fill(bucket, out, block_size, tables)
            if input_ids is not None:  # after the upload, on the same stream
                bucket.ids[:n].copy_(input_ids)
            if bucket.graph is None:
                return self._forward(bucket)[:n]
            bucket.graph.replay()
            assert bucket.logits is not None
            return bucket.logits[:n].clone()  # the next replay overwrites the buffer

    def _new_bucket(self, batch: int, width: int) -> _Bucket:
        bucket = _Bucket(batch, width, self.scratch_slot, self.device)
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

    def _fill(self, bucket: _Bucket, out: SchedulerOutput, block_size: int,
              tables: torch.Tensor) -> None:
        """Write this step's rows into the bucket's inputs (decode_rows) and upload them. The
        upload is asynchronous: staging is reused only once the last one has landed (a
        caller that never reads results back would otherwise overwrite it)."""
        if bucket.uploaded is not None:
            bucket.uploaded.synchronize()
        starts = torch.tensor([s.start for s in out.scheduled], dtype=torch.long)
        ids = torch.tensor([s.token_ids[0] for s in out.scheduled], dtype=torch.long)
        decode_rows(bucket.staging, ids, starts, tables, block_size, self.scratch_slot)
        bucket.packed.copy_(bucket.staging, non_blocking=True)
        bucket.uploaded = _landed_event(self.device)

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


def decode_rows(rows: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor,
                tables: torch.Tensor, block_size: int, scratch_slot: int) -> None:
    """A bucket's packed inputs rows [B, 4 + W] for n = len(ids) decode rows (as whole-batch
    tensor ops: the host work should not grow with batch x width in Python). tables: [n,
    >= 1] each row's block table (entries past its end are never read).

        row b < n:  ids[b] | starts[b] | starts[b] + 1 | slot(starts[b]) | slot(0) .. slot(W-1)
        row b >= n: 0      | 0         | 1             | scratch         | scratch ...

    slot(k) = tables[b, k // block_size] * block_size + k % block_size for the keys k <=
    starts[b]; the keys past it are masked and repeat slot(0), a slot of the row's own."""
    n, width = len(ids), rows.shape[1] - 4
    blocks = -(-width // block_size)
    if tables.shape[1] < blocks:  # the positions past them are masked below
        tables = torch.cat([tables, tables[:, :1].expand(n, blocks - tables.shape[1])], 1)
    tables = tables[:, :blocks]
    slots = (tables[:, :, None] * block_size
             + torch.arange(block_size)).flatten(1)[:, :width]  # [n, W]
    slots = torch.where(torch.arange(width) <= starts[:, None], slots, slots[:, :1])
    rows[:n, 0] = ids
    rows[:n, 1] = starts
    rows[:n, 2] = starts + 1
    rows[:n, 3] = slots.gather(1, starts[:, None]).squeeze(1)
    rows[:n, 4:] = slots
    pad_rows(rows, n, scratch_slot)


def pad_rows(rows: torch.Tensor, first: int, scratch_slot: int) -> None:
    """Rows from `first` on become padding: token 0 at position 0, one key, all slots
    scratch (outside the block pool: they never touch a sequence's cache)."""
    rows[first:, :2] = 0
    rows[first:, 2] = 1
    rows[first:, 3:] = scratch_slot


def _landed_event(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event recorded after the work queued so far (the host waits on it before
    it writes that work's pinned source again); None elsewhere, where copies are done when
    they return."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _round_up_pow2(n: int, low: int, high: int | None = None) -> int:
    size = low
    while size < n:
        size *= 2
    return size if high is None else min(size, high)
