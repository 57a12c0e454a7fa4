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
"""

from __future__ import annotations

from collections import deque


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

    def free(self, seq_id: str) -> None:
        """Give seq_id's slot back (nothing when it owns none)."""
        slot = self._owned.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
