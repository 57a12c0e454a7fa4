"""The ingress's view of its replicas: each one reports its /health and /metrics every second.

A replica pushes a `ReplicaReport` (the JSON of its own /health and the text of its own
/metrics, exactly what a single `kvlab serve` would answer); the board keeps the latest per
replica. A replica unheard of for `fresh_s` counts as unhealthy (it died, or its engine is
stuck); one unheard of for `forget_s` is dropped, as Serve will have replaced it by then.
Plain Python: the clock is an argument, so it is testable without Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

REPORT_PERIOD_S = 1.0


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # Serve's replica id
    health: dict[str, Any]  # the replica's /health body
    metrics: str  # the replica's /metrics text


@dataclass
class ReplicaBoard:
    fresh_s: float = 3 * REPORT_PERIOD_S
    forget_s: float = 30.0
    reports: dict[str, tuple[float, ReplicaReport]] = field(default_factory=dict)

    def update(self, report: ReplicaReport, now: float | None = None) -> None:
        self.reports[report.replica] = (time.monotonic() if now is None else now, report)

    def current(self, now: float | None = None) -> list[tuple[ReplicaReport, bool]]:
        """(report, healthy) of every replica not yet forgotten, by replica id."""
        now = time.monotonic() if now is None else now
        for rid in [r for r, (at, _) in self.reports.items() if now - at > self.forget_s]:
            del self.reports[rid]
        return [(rep, now - at <= self.fresh_s and rep.health.get("status") == "ok")
                for at, rep in sorted(self.reports.values(), key=lambda v: v[1].replica)]

    def health(self, now: float | None = None) -> dict[str, Any]:
        """/health of the whole application: replicas healthy of total, and each one's stats."""
        entries = self.current(now)
        healthy = sum(ok for _, ok in entries)
        model = next((rep.health.get("model") for rep, _ in entries), None)
        return {"status": "ok" if healthy else "unavailable", "model": model,
                "replicas": {"healthy": healthy, "total": len(entries)},
                "per_replica": [{"replica": rep.replica, "healthy": ok, **rep.health}
                                for rep, ok in entries]}
