"""Stop strings over streamed text: emit only text that cannot be the start of a stop string.

    deltas:   "Hel" "lo\\nUs" "er:"        stop = ["\\nUser:"]
    emitted:  "Hel" "lo"       (stop)      held back "\\nUs" until it was clearly a stop
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops, self.include_stop = stops, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Text that is now safe to emit; sets `stopped` when a stop string appears."""
        if not self.stops:
            return delta
        self.pending += delta
        hit = self._first_stop()
        if hit is not None:
            index, stop = hit
            self.stopped = True
            out = self.pending[:index + (len(stop) if self.include_stop else 0)]
            self.pending = ""
            return out
        if len(self.pending) <= self.hold:
            return ""
        cut = len(self.pending) - self.hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        return min(hits) if hits else None
