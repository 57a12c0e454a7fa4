"""The reasoning gate: on a thinking model a structure applies from the end of the reasoning
block, not to it, and an optional budget ends the block by forcing its end marker.

One GateState per gated sequence follows its output tokens (plain Python, no tensors):

    BEFORE ──start marker──> REASONING ──end marker (sampled, or forced at the budget)──> GAP
      │                                                                                  │
      └───────── any other token ─────────> STRUCTURE <──────── non-whitespace ──────────┘

    BEFORE     the reply may still open the block: the start marker's first token is allowed
               beside the structure's (the marker's other tokens are then forced)
    REASONING  nothing is enforced; the block's last tokens are matched against the end marker
    GAP        up to MAX_GAP whitespace tokens (the blank line templates put after `</think>`)
               are allowed beside the structure's first token, so the grammar stays strict
    STRUCTURE  the structure sees every further token

The tokens the gate takes (markers, reasoning, gap whitespace) never reach the structure's
matcher. A budget of N lets N tokens into the block; the token that reaches N is followed by
the rest of the end marker as forced tokens. Where the block's tail already spells the
marker's first k tokens, only the other len - k are forced:

    end = [a, b, c], budget 4:   x1 x2 x3 a | b c      (the 4th token began the marker)
                                 x1 x2 x3 x4 | a b c
"""

from __future__ import annotations

import enum

from kvlab.request import ReasoningGate

MAX_GAP = 4  # whitespace tokens allowed between the block and the structure


class Phase(enum.Enum):
    BEFORE = "before"
    REASONING = "reasoning"
    GAP = "gap"
    STRUCTURE = "structure"


class GateState:
    """Where one sequence's output is relative to its reasoning block."""

    def __init__(self, gate: ReasoningGate) -> None:
        self.gate = gate
        self.phase = Phase.REASONING if gate.inside else Phase.BEFORE
        self.used = 0  # tokens taken into the block, a sampled end marker's own included
        self.gap = 0  # whitespace tokens taken outside the block
        self._tail: list[int] = []  # the block's last len(end_ids) tokens
        self._pending: list[int] = []  # the start marker's tokens still to force

    @property
    def over_budget(self) -> bool:
        """The block has used its budget without ending: only the end marker may follow."""
        budget = self.gate.budget
        return self.phase is Phase.REASONING and budget is not None and self.used >= budget

    @property
    def free(self) -> bool:
        """Nothing is enforced on the next token: inside the block, within the budget."""
        return self.phase is Phase.REASONING and not self.over_budget

    def extras(self) -> tuple[tuple[int, ...], bool]:
        """(tokens, whether whitespace) the gate allows beside the structure's next tokens."""
        room = self.gap < MAX_GAP
        if self.phase is Phase.BEFORE:
            return (self.gate.start_ids[0],), room
        return (), room and self.phase is Phase.GAP

    def next_end_token(self) -> int:
        """The end marker's token that continues the block's tail."""
        return self.gate.end_ids[self._overlap()]

    def take(self, token: int, whitespace: bool) -> bool:
        """Consume a sampled token if it is the gate's; False hands it (and every later one)
        to the structure."""
        if self.phase is Phase.REASONING:
            self.used += 1
            self._push(token)
            return True
        if self.phase is Phase.BEFORE and token == self.gate.start_ids[0]:
            self._pending = list(self.gate.start_ids[1:])
            self.phase = Phase.REASONING
            return True
        if self.phase is not Phase.STRUCTURE and whitespace and self.gap < MAX_GAP:
            self.gap += 1
            return True
        self.phase = Phase.STRUCTURE
        return False

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the gate forces now, already taken: the rest of a sampled
        start marker, then the end marker once the budget is used."""
        out = self._pending[:max(0, limit)]
        del self._pending[:len(out)]
        if self.over_budget:
            for token in self.gate.end_ids[self._overlap():][:max(0, limit - len(out))]:
                out.append(token)
                self._push(token)
        return out

    def _push(self, token: int) -> None:
        end = self.gate.end_ids
        self._tail = (self._tail + [token])[-len(end):]
        if tuple(self._tail) == end:
            self.phase, self.gap = Phase.GAP, 0

    def _overlap(self) -> int:
        """The largest k < len(end_ids) with the tail ending in end_ids[:k]."""
        end = self.gate.end_ids
        for k in range(min(len(end) - 1, len(self._tail)), 0, -1):
            if tuple(self._tail[-k:]) == end[:k]:
                return k
        return 0
