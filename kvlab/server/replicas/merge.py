"""The replicas' /metrics texts as one exposition, every sample labelled with its replica.

Each replica's text is parsed with `prometheus_client` and re-emitted under the same metric
names (kvlab's `kvlab:*` names, unchanged) with a `replica` label added, so a dashboard sums
over `replica` or breaks a figure down by it. Two gauges of the application itself say how
many replicas are reporting and how many of those are healthy.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class _Merged(Collector):
    def __init__(self, texts: dict[str, str], healthy: int) -> None:
        self.texts = texts
        self.healthy = healthy

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for fam in text_string_to_metric_families(text):
                merged = families.setdefault(fam.name,
                                             Metric(fam.name, fam.documentation, fam.type))
                for s in fam.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value)
        yield from families.values()
        yield GaugeMetricFamily("kvlab:replicas", "Replicas reporting to the ingress.",
                                value=len(self.texts))
        yield GaugeMetricFamily("kvlab:replicas_healthy",
                                "Replicas reporting to the ingress and healthy.",
                                value=self.healthy)


def merge_metrics(texts: dict[str, str], healthy: int) -> bytes:
    """One Prometheus text from {replica id: that replica's /metrics text}."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts, healthy))
    return generate_latest(registry)
