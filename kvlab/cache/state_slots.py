"""State slots of the recurrent layers: one fixed-size state per running sequence.

Plain Python, no torch. A hybrid model's recurrent layers (short convolutions, Gated
DeltaNet) carry a state of fixed size per sequence instead of KV that grows with it. The
runner holds those states as tensors with one row per slot, the same row index in every
recurrent layer; this module only decides which row (slot) each sequence owns:

    slots          0     1     2     3
    owner        "a"   free  "c"   free       free list: [1, 3]
    allocate("d") -> 1;  free("a") -> slot 0 back on the free list

A slot is taken when a sequence is admitted and given back when it finishes or is
preempted; a preempted sequence is recomputed from token 0 into whichever slot it gets
next, so a slot's state never outlives its owner.

For the prefix cache, StateSnapshots keeps states at block boundaries in rows of their own
(after the slots' rows, in the same tensors): a repeated prefix resumes from the deepest
snapshot instead of token 0. A chat's next turn repeats the whole last turn, prompt and
answer, so besides every k-th block a sequence saves its state at the last full block of its
prompt and, while it decodes, at each block boundary into one row of its own (its tail),
which becomes a snapshot when the sequence is done.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class StateSlots:
    """Which state slot each sequence (by id) owns, out of `num_slots`."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"{num_slots} state slots (need >= 1)")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owned: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, seq_id: str) -> bool:
        """seq_id owns a slot already, or one is free."""
        return seq_id in self._owned or bool(self._free)

    def allocate(self, seq_id: str) -> int:
        """seq_id's slot, taking a free one on first call; raises when none is free."""
        slot = self._owned.get(seq_id)
        if slot is not None:
            return slot
        if not self._free:
            raise ValueError(f"no free state slot for {seq_id!r}: all {self.num_slots} "
                             "are owned (call can_allocate first)")
        slot = self._owned[seq_id] = self._free.popleft()
        return slot

    def slot(self, seq_id: str) -> int | None:
        """seq_id's slot, or None when it owns none."""
        return self._owned.get(seq_id)

    def owners(self) -> dict[str, int]:
        """Each sequence that owns a slot, and its slot (a copy)."""
        return dict(self._owned)

    def free(self, seq_id: str) -> None:
        """Give seq_id's slot back (nothing when it owns none)."""
        slot = self._owned.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)


@dataclass(frozen=True)
class SnapshotSpec:
    """Rows that keep recurrent states at block boundaries, for the prefix cache."""

    num_rows: int  # snapshot rows, numbered after the slots' rows
    every_blocks: int  # k: a snapshot where a step ends on a multiple of k blocks


class StateSnapshots:
    """Recurrent states saved where a sequence's step ended on a snapshot boundary, found
    again by the content_id of the cached block that ends there (kvlab.cache.block_pool):

        block          0    1    2    3    4    5    6    7      every_blocks = 2
        prompt         p    p    p    p    p  p |                a 22-token prompt
        boundary            ^         ^         ^ ^               every k-th block, and the
                                                                  prompt's last full block
        decode                                          t    t    tail: the last one reached
        prefix hit of 5 blocks -> resume from the snapshot after block 3 (4 blocks)

    Steps are cut to end on those boundaries (`cut`); a decode step ends on each block
    boundary in turn, and the sequence's tail row is overwritten there, so a finished
    sequence leaves one snapshot at the deepest block it computed.

    A content_id is given once per registration, so a snapshot whose block was evicted (and
    maybe registered again with other KV) is never found: it is dead, and its row is the
    first taken when rows run out (least recently used first). A row being saved into is the
    sequence's until its block is registered (its tail until the sequence is released); a
    row being restored from is pinned until the step that reads it has run. When no row can
    be had, the state is not saved: a later hit resumes from a shallower snapshot.
    """

    def __init__(self, spec: SnapshotSpec, first_row: int, block_size: int) -> None:
        if spec.num_rows < 1 or spec.every_blocks < 1:
            raise ValueError(f"{spec}: need at least one row, every >= 1 blocks")
        self.every_blocks, self.block_size = spec.every_blocks, block_size
        self.num_rows = spec.num_rows
        self.stride = spec.every_blocks * block_size  # tokens between boundaries
        self._free: deque[int] = deque(range(first_row, first_row + spec.num_rows))
        self._rows: OrderedDict[int, int] = OrderedDict()  # content_id -> row, LRU first
        self._pending: dict[str, dict[int, int]] = {}  # seq -> {block index: row}
        self._tail: dict[str, tuple[int, int]] = {}  # seq -> (row, block index it ends)
        self._pinned: dict[str, int] = {}  # seq -> the row it restores from

    def cut(self, start: int, end: int, num_prompt_tokens: int) -> int:
        """The end of a step over [start, end): the last boundary inside it (a multiple of
        the stride, or the prompt's last full block), so the state there can be saved, or
        `end` itself when that is one or none is inside."""
        last = end // self.stride * self.stride
        prompt_end = num_prompt_tokens // self.block_size * self.block_size
        if last < prompt_end < end:
            last = prompt_end
        return last if start < last < end else end

    def usable(self, hit_content_ids: list[int]) -> int:
        """How many blocks of a prefix hit can be resumed: the most whose last block has a
        snapshot (0 when none has)."""
        for n in range(len(hit_content_ids), 0, -1):
            if hit_content_ids[n - 1] in self._rows:
                return n
        return 0

    def restore(self, seq_id: str, content_id: int) -> int:
        """The row seq_id's first step resumes from (the snapshot after this block)."""
        row = self._rows[content_id]
        self._rows.move_to_end(content_id)
        self._pinned[seq_id] = row
        return row

    def reserve(self, seq_id: str, end: int, num_prompt_tokens: int) -> int | None:
        """A row to save seq_id's state into when a step ends at `end`; None when `end` is
        no boundary or no row can be had. The same row on every call for one boundary; a
        block boundary past the prompt's last full block takes the sequence's tail row."""
        if end <= 0 or end % self.block_size:
            return None
        block, prompt_end = end // self.block_size - 1, num_prompt_tokens // self.block_size
        if end % self.stride and block + 1 != prompt_end:
            return self._reserve_tail(seq_id, block) if block >= prompt_end else None
        pending = self._pending.setdefault(seq_id, {})
        if block not in pending:
            row = self._take()
            if row is None:
                return None
            pending[block] = row
        return pending[block]

    def _reserve_tail(self, seq_id: str, block: int) -> int | None:
        tail = self._tail.get(seq_id)
        row = tail[0] if tail is not None else self._take()
        if row is not None:
            self._tail[seq_id] = (row, block)
        return row

    def saving(self, seq_id: str, end: int) -> int | None:
        """The row reserved for seq_id's state at `end`, if any."""
        if end <= 0 or end % self.block_size:
            return None
        block = end // self.block_size - 1
        tail = self._tail.get(seq_id)
        if tail is not None and tail[1] == block:
            return tail[0]
        return self._pending.get(seq_id, {}).get(block)

    def restoring(self, seq_id: str) -> int | None:
        """The row seq_id's first step resumes from, until that step has run."""
        return self._pinned.get(seq_id)

    def _take(self) -> int | None:
        if self._free:
            return self._free.popleft()
        pinned = set(self._pinned.values())
        oldest = next((c for c, r in self._rows.items() if r not in pinned), None)
        return None if oldest is None else self._rows.pop(oldest)

    def commit(self, seq_id: str, links: list[int], num_full: int) -> None:
        """After seq_id's step: a saved row whose block is now registered (its content_id in
        `links`) becomes that block's snapshot; one whose block is full but could not be
        registered (a prefix-key collision) is given back. The restore row is unpinned.
        The tail row stays the sequence's (see release)."""
        self._pinned.pop(seq_id, None)
        pending = self._pending.get(seq_id, {})
        for block in [b for b in pending if b < num_full]:
            self._keep(pending.pop(block), block, links)

    def _keep(self, row: int, block: int, links: list[int]) -> None:
        """The row's state ends `block`: that block's snapshot when it is registered (and
        has none yet), else the row is free again."""
        content = links[block] if block < len(links) else None
        if content is None or content in self._rows:  # not cached, or a duplicate's
            self._free.append(row)
        else:
            self._rows[content] = row

    @property
    def num_saved(self) -> int:
        """Rows holding a block's snapshot (live, or dead until taken again)."""
        return len(self._rows)

    @property
    def num_used(self) -> int:
        """Rows not free: saved snapshots plus rows being saved into."""
        return self.num_rows - len(self._free)

    def release(self, seq_id: str, links: list[int]) -> None:
        """seq_id is gone: rows it was saving into go back, its restore row is unpinned, and
        its tail becomes the snapshot of the block it ends when that block is registered
        (a content_id in `links`; a step that never ran registered none)."""
        self._pinned.pop(seq_id, None)
        self._free.extend(self._pending.pop(seq_id, {}).values())
        tail = self._tail.pop(seq_id, None)
        if tail is not None:
            self._keep(*tail, links)


@dataclass(frozen=True)
class StateUsage:
    """The state rows now: slots owned by running sequences, snapshot rows in use."""

    slots_total: int
    owners: dict[str, int]  # sequence id -> its slot
    snapshot_rows_total: int = 0
    snapshot_rows_used: int = 0  # saved snapshots plus rows being saved into
    snapshots_saved: int = 0

    @property
    def slots_used(self) -> int:
        return len(self.owners)


def state_usage(slots: StateSlots | None, snapshots: StateSnapshots | None
                ) -> StateUsage | None:
    """What `slots` and `snapshots` hold now; None for a model without recurrent layers."""
    if slots is None:
        return None
    if snapshots is None:
        return StateUsage(slots.num_slots, slots.owners())
    return StateUsage(slots.num_slots, slots.owners(), snapshots.num_rows, snapshots.num_used,
                      snapshots.num_saved)
