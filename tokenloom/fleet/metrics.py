"""/metrics of a fleet: every replica's series with a `replica` label, and the fleet's total without one.

Each replica reports its own Prometheus text (replica.py's routing stats, about once a second); this
parses those with prometheus_client's parser and writes one exposition. Counters, histograms and
gauges of counts are summed; a gauge that is a fraction (`*_perc`, `*_rate`) is averaged over the
replicas instead, since a sum of fractions means nothing.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def _is_fraction(family: str) -> bool:
    return family.endswith(("_perc", "_rate"))


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One exposition from the replicas' texts (replica id -> Prometheus text)."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                if not s.name.endswith("_created"):  # a start time: summing it means nothing
                    totals[fam.name][(s.name, tuple(sorted(s.labels.items())))].append(s.value)
    for name, by_series in totals.items():
        for (sample, labels), values in by_series.items():
            value = sum(values) / len(values) if _is_fraction(name) else sum(values)
            families[name].add_sample(sample, dict(labels), value)
    return generate_latest(_Fixed(families.values()))


class _Fixed(CollectorRegistry):
    """A registry that yields given metric families (generate_latest's input)."""

    def __init__(self, families):
        super().__init__(auto_describe=False)
        self._families = list(families)

    def collect(self):
        yield from self._families


class FleetMetrics:
    """What the server's /metrics route calls (`render()`), over the replicas' latest reports."""

    def __init__(self, stats):
        self._stats = stats  # () -> {replica id: routing stats dict}

    def render(self) -> bytes:
        return merge_metrics({rid: s["metrics"] for rid, s in self._stats().items() if s.get("metrics")})
