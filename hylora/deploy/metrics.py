"""/metrics of a Ray deployment: the ingress's own counters, and every replica's `hylora serve`
metrics with a `replica` label.

Each replica renders its own /metrics (the same app as `hylora serve`) every few seconds and sends
the text to the ingress; the ingress serves the latest text of each live replica, relabelled. A
replica that stopped reporting (dead, replaced) drops out after a few periods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PUSH_INTERVAL_S = 2.0


class IngressMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.responses = Counter(
            "hylora_ingress_responses",
            "Responses relayed by the ingress, by replica and HTTP status",
            ["replica", "code"],
            registry=r,
        )
        self.replica_failures = Counter(
            "hylora_replica_failures",
            "Requests ended by the ingress because their replica failed (died, unreachable)",
            ["stage"],
            registry=r,
        )
        self.in_flight = Gauge("hylora_ingress_requests_in_flight", "Requests being relayed", registry=r)
        self.replicas_reporting = Gauge(
            "hylora_replicas_reporting", "Replicas whose metrics reached the ingress recently", registry=r
        )


class ReplicaMetricsBoard:
    """The latest metrics text of each replica."""

    def __init__(self, stale_after_s: float = 5 * PUSH_INTERVAL_S):
        self.stale_after_s = stale_after_s
        self._texts: dict[str, tuple[float, str]] = {}

    def report(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def live(self) -> dict[str, str]:
        now = time.monotonic()
        self._texts = {r: (t, s) for r, (t, s) in self._texts.items() if now - t <= self.stale_after_s}
        return {r: s for r, (_, s) in self._texts.items()}

    def render(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(_Relabelled(self.live()))
        return generate_latest(registry)


class _Relabelled:
    """A collector: the families of several replicas' texts merged, each sample labelled with its replica."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [
                    Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                ]
        yield from families.values()
