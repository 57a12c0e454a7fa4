"""Counts of proposed and accepted tokens, for /metrics, usage and the benchmarks.

Plain Python. A verify run is one sequence's proposals checked in one step; its acceptance
length is how many of them were kept (0 .. proposed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecCounts:
    runs: int = 0  # verify runs
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of which kept
    lengths: dict[int, int] = field(default_factory=dict)  # acceptance length -> runs

    def record(self, proposed: int, accepted: int) -> None:
        self.runs += 1
        self.drafted += proposed
        self.accepted += accepted
        self.lengths[accepted] = self.lengths.get(accepted, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def copy(self) -> SpecCounts:
        return replace(self, lengths=dict(self.lengths))
