"""A step's input tensors (token ids, positions, attention metadata) from rows kept across
steps: the runner's persistent batch.

Built from scratch, a decode step's inputs cost a Python pass and a few small tensors per
sequence over its whole block table, every step: host work that grows with batch x context.
Here each sequence owns a row of a block-table tensor, written when it first comes and
extended only by the blocks it gains; a step gathers its sequences' rows and expands them
to slots in whole-batch tensor ops:

    rows        {seq_id: r}                      a row nobody uses is reused
    tables      [rows, max_blocks] int64         row r: its block ids, in position order
    one step    index[b] = row of decode row b,  pos[b] = its position
                slots[b, k] = tables[index[b], k // bs] * bs + k % bs   [B, W]
                write[b]    = slots[b, pos[b]]

A row is checked against the step's block table each time it is used (the blocks it holds
must be the table's first ones, compared as Python lists, no tensor work): a truncated table
(rejected proposals), a preempted sequence that came back with other blocks, or a caller
that reuses an id for other blocks gets its row written again, so the inputs always equal a
fresh build from the block tables.

A sequence's part of a step is one span of its known tokens, then one decode row per
proposed token (speculative decoding), attending to the keys up to its own position:
causal among them, and computed as decoding them one step at a time would (the one-call C
decode takes such a step), so greedy verification reproduces plain decoding's text. A span
of one token is a decode row too:

    positions   7  8 |  9 | 10 | 11
    tokens     o3 f1 | d1 | d2 | d3     (o3 sampled, f1 forced, d1-d3 proposed)
    rows       7 + 2 | 9+1|10+1|11+1    (start + num_new; keys: positions < end)

Most steps are the last decode step's sequences, each one position on. Such a step's
inputs follow from the last one's (_LastDecode) without a pass over the block tables: each
row's new key slot is written in place at its position into keys kept with spare columns
(padded with the rows' first slots; doubled when a row reaches the last one), and only the
rows whose table gained a block are written:

    last keys   [B, C]      a: s0 s1 s2 s0 s0 s0   (a at position 2, C = 6 columns)
    this step   [B, C]      a: s0 s1 s2 s3 s0 s0   (slot s3 of position 3 written in)
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kvlab.models.attention import (
    AttentionMetadata,
    DecodeRows,
    SeqSpan,
    on_device,
    step_metadata,
)
from kvlab.scheduler import ScheduledSeq, SchedulerOutput


@dataclass(eq=False)
class _Row:
    index: int  # into BlockRows.tables
    table: list[int | None]  # the blocks written into the row, as the scheduler gave them
    used: int  # the last step that read it


class BlockRows:
    """One pool's block tables as rows of a tensor, by sequence id. `scratch`: the block a
    released (None) entry of a sliding-window table points at (never read)."""

    def __init__(self, scratch: int = 0) -> None:
        self.tables = torch.zeros(8, 8, dtype=torch.long)  # [rows, blocks]
        self.scratch = scratch
        self.step = 0  # advanced by begin(); rows read in this step are not reused
        self._rows: dict[str, _Row] = {}
        self._free = list(range(self.tables.shape[0]))

    def begin(self) -> None:
        self.step += 1

    def row(self, seq_id: str, table: list[int] | list[int | None]) -> int:
        """The row holding seq_id's block table, written or extended where it differs."""
        r = self._rows.get(seq_id)
        if r is None:
            r = self._rows[seq_id] = _Row(self._take(), [], self.step)
        if table != r.table:
            known = len(r.table)
            keep = known if len(table) > known and table[:known] == r.table else 0
            self._write(r, table, keep)
        r.used = self.step
        return r.index

    def extend(self, grown: list[tuple[str, list[int]]]) -> None:
        """Write the blocks each (seq_id, table) gained, in one tensor op: its row holds the
        table's first blocks already."""
        width = max(len(table) for _, table in grown)
        if width > self.tables.shape[1]:
            self._grow(self.tables.shape[0], max(width, 2 * self.tables.shape[1]))
        rows: list[int] = []
        cols: list[int] = []
        blocks: list[int] = []
        for seq_id, table in grown:
            r = self._rows[seq_id]
            known = len(r.table)
            rows += [r.index] * (len(table) - known)
            cols += range(known, len(table))
            blocks += table[known:]
            r.table, r.used = list(table), self.step
        self.tables[_long(rows), _long(cols)] = _long(blocks)

    def drop(self, seq_id: str) -> None:
        r = self._rows.pop(seq_id, None)
        if r is not None:
            self._free.append(r.index)

    def _write(self, r: _Row, table: list[int] | list[int | None], keep: int) -> None:
        """Write table[keep:] into r's row (its first `keep` blocks are already there)."""
        if len(table) > self.tables.shape[1]:
            self._grow(self.tables.shape[0], max(len(table), 2 * self.tables.shape[1]))
        new = [self.scratch if b is None else b for b in table[keep:]]
        self.tables[r.index, keep:len(table)] = torch.tensor(new, dtype=torch.long)
        r.table = list(table)

    def _take(self) -> int:
        """A free row; else the least recently read one not read in this step; else a new
        one (the tensor doubles)."""
        if self._free:
            return self._free.pop()
        idle = [(r.used, seq_id) for seq_id, r in self._rows.items() if r.used < self.step]
        if idle:
            _, seq_id = min(idle)
            return self._rows.pop(seq_id).index
        rows = self.tables.shape[0]
        self._grow(2 * rows, self.tables.shape[1])
        self._free = list(range(2 * rows - 1, rows, -1))
        return rows

    def _grow(self, rows: int, blocks: int) -> None:
        grown = torch.zeros(rows, blocks, dtype=torch.long)
        old_rows, old_blocks = self.tables.shape
        grown[:old_rows, :old_blocks] = self.tables
        self.tables = grown


@dataclass(eq=False)
class _LastDecode:
    """A decode-only step's rows (one pool, no window), kept for the next step."""

    seq_ids: list[str]
    tables: list[list[int]]  # the block tables it was built from (never changed after)
    index: torch.Tensor  # [B] their rows in BlockRows.tables
    end: torch.Tensor  # [B] keys each row saw: its position + 1
    keys: torch.Tensor  # [B, C >= hi] DecodeRows.slots, written in place by the next step
    packed: torch.Tensor  # [B] 0..B-1
    lo: int  # min(end)
    hi: int  # max(end)
    serial: int | None  # SchedulerOutput.serial of the step


def _long(values: list[int]) -> torch.Tensor:
    """[len(values)] int64 from a list of ints (through an array: torch.tensor reads a list
    an element at a time)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor  # [T] token ids, the scheduled sequences' tokens packed in order
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # a step of one-token rows: the scheduled sequences' ids in order, where the batch kept
    # them (the last step's list, shared); None otherwise
    seq_ids: list[str] | None = None


class PersistentBatch:
    """Block-table rows of the sequences a runner has seen, and the step inputs built from
    them. `window_scratch`: the sliding-window pool's scratch block, where its layers have a
    pool of their own (ScheduledSeq.window_table); None otherwise."""

    def __init__(self, block_size: int, window: int | None, window_scratch: int | None,
                 device: torch.device) -> None:
        self.block_size, self.window, self.device = block_size, window, device
        self.full = BlockRows()
        self.windowed = BlockRows(window_scratch) if window_scratch is not None else None
        self._offsets = torch.arange(block_size)
        self._last: _LastDecode | None = None  # the last step, where it was decode-only

    def inputs(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None
               ) -> StepInputs:
        """The step's input tensors; `input_ids`: its token ids, already on the device, where its
        ScheduledSeqs hold stand-ins (a step scheduled ahead)."""
        for seq_id in out.preempted:  # their blocks went back to the pool
            self.forget(seq_id)
        self.full.begin()
        if self.windowed is not None:
            self.windowed.begin()
        elif out.scheduled and out.num_tokens == len(out.scheduled):
            return self._decode_only(out, input_ids)
        self._last = None
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        offsets: list[int] = []
        decode: tuple[list[int], list[int | None], list[int], list[int]] = ([], [], [], [])
        rows, wrows, at, packed = decode
        full_row = self.full.row
        for s in out.scheduled:
            row = full_row(s.seq_id, s.block_table)
            wrow = None if s.window_table is None else self._window_row(s)
            n = len(s.token_ids)
            if n == 1:  # a decode row (the common case, kept short)
                rows.append(row)
                wrows.append(wrow)
                at.append(s.start)
                packed.append(len(ids))
                ids.append(s.token_ids[0])
                positions.append(s.start)
                continue
            proposed = s.num_logits - 1 if s.needs_logits else 0
            known = n - proposed
            if known > 1:
                spans.append(self._span(s, row, wrow, known))
                offsets.append(len(ids))
            first = s.start if known == 1 else s.start + known
            for pos in range(first, s.start + n):  # one decode row each
                rows.append(row)
                wrows.append(wrow)
                at.append(pos)
                packed.append(len(ids) + pos - s.start)
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + n))
        ids_t = _long(ids)
        if len(at) == len(ids):  # decode rows only: the positions are theirs, packed in order
            at_t = _long(at)
            decoded = self._decode_rows(_long(rows), wrows, at_t, torch.arange(len(ids)))
            positions_t = at_t
        else:
            positions_t = _long(positions)
            decoded = (self._decode_rows(_long(rows), wrows, _long(at), _long(packed))
                       if rows else None)
        meta = step_metadata(spans, offsets, decoded, len(ids), self.window, self.device)
        return StepInputs(ids_t.to(self.device) if input_ids is None else input_ids,
                          positions_t.to(self.device), meta)

    def _decode_only(self, out: SchedulerOutput, ids: torch.Tensor | None) -> StepInputs:
        """inputs() of a step of one-token rows over one pool (most decode steps): the same
        result, from the last step's where it can (_follow, _next_decode), else in a few
        list comprehensions."""
        scheduled, last = out.scheduled, self._last
        if ids is None:
            ids = _long([s.token_ids[0] for s in scheduled]).to(self.device)
        decoded = None
        if last is not None and out.follows is not None and out.follows == last.serial:
            at = last.end  # the same sequences, each one position on
            decoded = self._follow(out, last)
        else:
            at = _long([s.start for s in scheduled])
            if not self.window:
                decoded = self._next_decode(out, at)
        if decoded is None:
            row = self.full.row
            index = _long([row(s.seq_id, s.block_table) for s in scheduled])
            packed = torch.arange(len(scheduled))
            decoded = self._decode_rows(index, [None] * len(scheduled), at, packed)
            self._last = None if self.window else _LastDecode(
                [s.seq_id for s in scheduled], [s.block_table for s in scheduled], index,
                decoded.lengths, decoded.slots, packed, int(decoded.lengths.min()),
                decoded.width, out.serial)
        meta = step_metadata([], [], decoded, len(scheduled), self.window, self.device)
        seq_ids = None if self._last is None else self._last.seq_ids
        return StepInputs(ids, on_device(at, self.device), meta, seq_ids)

    def _follow(self, out: SchedulerOutput, last: _LastDecode) -> DecodeRows | None:
        """_next_decode of a step that says it repeats the last one (SchedulerOutput.follows):
        only the rows whose table grew are looked at."""
        tables = last.tables
        if out.grown:
            tables = list(tables)
            for i in out.grown:
                tables[i] = out.scheduled[i].block_table
            if any(tables[i][:len(last.tables[i])] != last.tables[i] for i in out.grown):
                return None  # a table not only grown: its keys so far are others
            self.full.extend([(last.seq_ids[i], tables[i]) for i in out.grown])
        return self._advance(last, last.seq_ids, tables, last.end, out.serial)

    def _next_decode(self, out: SchedulerOutput, at: torch.Tensor) -> DecodeRows | None:
        """The decode rows of a step of the last step's sequences, in its order, each one
        position on and its block table as it was or grown (see the module's diagram);
        None for any other step. The blocks tables gained are written (BlockRows.extend)."""
        last, scheduled = self._last, out.scheduled
        seq_ids = [s.seq_id for s in scheduled]
        if last is None or seq_ids != last.seq_ids or not torch.equal(at, last.end):
            return None
        tables = [s.block_table for s in scheduled]
        changed = [i for i, (t, u) in enumerate(zip(tables, last.tables))
                   if t is not u and t != u]
        if changed:
            if any(tables[i][:len(last.tables[i])] != last.tables[i] for i in changed):
                return None  # a table not only grown: its keys so far are others
            self.full.extend([(seq_ids[i], tables[i]) for i in changed])
        return self._advance(last, seq_ids, tables, at, out.serial)

    def _advance(self, last: _LastDecode, seq_ids: list[str], tables: list[list[int]],
                 at: torch.Tensor, serial: int | None) -> DecodeRows:
        """The decode rows of `last`'s sequences at positions `at` (last's ends): one more
        key each, its new slot written in place into last's keys (their spare columns
        doubled first where a row reaches past them). Last's rows are not read again."""
        bs = self.block_size
        write = (at % bs).add_(self.full.tables[last.index, at // bs], alpha=bs)  # slot
        keys, lo, hi = last.keys, last.lo + 1, last.hi + 1
        if hi > keys.shape[1]:  # padded with each row's first slot
            keys = torch.cat((keys, keys[:, :1].expand(-1, keys.shape[1])), 1)
        keys.scatter_(1, at[:, None], write[:, None])
        end = at + 1
        self._last = _LastDecode(seq_ids, tables, last.index, end, keys, last.packed, lo, hi,
                                 serial)
        return DecodeRows(last.packed, write, keys, end, hi, uniform=lo == hi)

    def tables(self, out: SchedulerOutput) -> torch.Tensor:
        """[n, blocks] the scheduled sequences' block tables, one row each in scheduled order
        (entries past a table's end are stale), for the decode graphs' buffers."""
        for seq_id in out.preempted:
            self.forget(seq_id)
        self.full.begin()
        self._last = None
        row = self.full.row
        index = [row(s.seq_id, s.block_table) for s in out.scheduled]
        return self.full.tables.index_select(0, _long(index))

    def forget(self, seq_id: str) -> None:
        self._last = None
        self.full.drop(seq_id)
        if self.windowed is not None:
            self.windowed.drop(seq_id)

    def _window_row(self, s: ScheduledSeq) -> int | None:
        if s.window_table is None:
            return None
        if self.windowed is None:
            raise ValueError(f"{s.seq_id!r} has a window table, but the runner has no "
                             "sliding-window pool")
        return self.windowed.row(s.seq_id, s.window_table)

    def _span(self, s: ScheduledSeq, row: int, wrow: int | None, known: int) -> SeqSpan:
        """The span of a sequence's first `known` tokens this step (several)."""
        end = s.start + known
        index = torch.tensor([row])
        window = None
        if wrow is not None:
            assert self.windowed is not None
            window = self._slots(self.windowed.tables, torch.tensor([wrow]), end)[0]
        return SeqSpan(s.start, known, self._slots(self.full.tables, index, end)[0], window)

    def _slots(self, tables: torch.Tensor, index: torch.Tensor, end: int) -> torch.Tensor:
        """[len(index), end] slot of positions 0..end-1 of the rows `index`."""
        blocks = -(-end // self.block_size)
        table = tables.index_select(0, index)[:, :blocks]
        return (table[:, :, None] * self.block_size + self._offsets).flatten(1)[:, :end]

    def _decode_rows(self, index: torch.Tensor, wrows: list[int | None], at: torch.Tensor,
                     packed: torch.Tensor) -> DecodeRows:
        """The decode rows of a step as whole-batch tensors (see DecodeRows): block-table
        rows `index` (and `wrows` in the window pool), positions `at`, packed offsets."""
        end = at + 1
        lo, width = int(end.min()), int(end.max())
        slots = self._slots(self.full.tables, index, width)  # [B, max end]
        keys, lengths = (slots, end) if lo == width else _keys(slots, end, None, width)
        write = slots.gather(1, at[:, None]).squeeze(1)
        rows_t = packed
        if not self.window:
            return DecodeRows(rows_t, write, keys, lengths, width, uniform=lo == width)
        own = None
        if wrows[0] is not None:  # the window layers' own pool (all rows, or none, have one)
            assert self.windowed is not None
            if None in wrows:
                raise ValueError("either every row has window slots or none has")
            own = self._slots(self.windowed.tables, _long(wrows), width)
        wkeys, wlengths = _keys(slots if own is None else own, end, self.window)
        return DecodeRows(rows_t, write, keys, lengths, width, wkeys, wlengths,
                          None if own is None else own.gather(1, at[:, None]).squeeze(1),
                          lo == width)


def _keys(slots: torch.Tensor, end: torch.Tensor, window: int | None,
          width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, W] the slots of the keys each row sees, padded with its first key's slot;
    [B] how many): positions [first, end) with first = end - window (or 0). `width`:
    max(end), where the caller knows it."""
    if not window:  # first = 0: the slots of positions 0..end-1, padded
        width = int(end.max()) if width is None else width
        k = torch.arange(width)[None, :]
        return torch.where(k < end[:, None], slots[:, :width], slots[:, :1]), end
    first = (end - window).clamp_min(0)
    lengths = end - first
    k = torch.arange(int(lengths.max()))[None, :]
    index = first[:, None] + torch.where(k < lengths[:, None], k, 0)
    return slots.gather(1, index), lengths
