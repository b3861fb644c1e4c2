"""Metrics as values, in vLLM's shape (`vllm.v1.metrics.reader`): what `LLM.get_metrics()` returns.

`get_metrics_snapshot(registry)` reads a `PrometheusStatLogger`'s registry into `Counter`,
`Gauge` and `Histogram` dataclasses, one per series, as vLLM's reader does (vLLM reads the
global registry; ours is the logger's own). `aggregate_engines` sums the series of the
data-parallel replicas into one, dropping the `engine` label: counters, histogram buckets,
counts and sums, and gauges of request counts add up; a `_perc` gauge (KV cache usage) is the
mean, which is the fraction of all replicas' blocks in use since replicas have like pools, and
so is an `_info` gauge (always 1: replicas of one configuration merge into one series).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as PromMetric

from jaxengine.metrics.prometheus import PREFIX

ENGINE_LABEL = "engine"


@dataclass
class Metric:
    """One series: a metric name and its labels (the same name recurs with other labels)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's per-position speculative-decoding
    acceptance counts; no jaxengine metric has this type yet: there are no draft tokens)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound ("0.5", ..., "+Inf") to the
    cumulative count up to it; `count` is the "+Inf" count, `sum` the sum of observations."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every `jaxengine:` series of `registry`, one dataclass each, in registry order."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(name=family.name, labels=s.labels, value=s.value)
                          for s in _samples(family, "")]
        elif family.type == "counter":
            collected += [Counter(name=family.name, labels=s.labels, value=int(s.value))
                          for s in _samples(family, "_total")]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _samples(family: PromMetric, suffix: str) -> list:
    name = family.name + suffix
    return [s for s in family.samples if s.name == name]


def _histograms(family: PromMetric) -> list[Histogram]:
    """One `Histogram` per label set of the family's `_bucket`, `_count` and `_sum` samples."""
    out: dict[frozenset, Histogram] = {}
    for s in _samples(family, "_count"):
        out[frozenset(s.labels.items())] = Histogram(
            name=family.name, labels=dict(s.labels), count=int(s.value), sum=0.0, buckets={})
    for s in _samples(family, "_sum"):
        out[frozenset(s.labels.items())].sum = s.value
    for s in _samples(family, "_bucket"):
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        out[frozenset(labels.items())].buckets[s.labels["le"]] = int(s.value)
    return list(out.values())


def aggregate_engines(metrics: Iterable[Metric]) -> list[Metric]:
    """The series of all replicas summed into one per name and other labels (see module doc).

    The result keeps the order in which each (name, labels) first appears, and has no
    `engine` label.
    """
    merged: dict[tuple[str, frozenset], Metric] = {}
    replicas: dict[tuple[str, frozenset], int] = {}
    for m in metrics:
        labels = {k: v for k, v in m.labels.items() if k != ENGINE_LABEL}
        key = (m.name, frozenset(labels.items()))
        replicas[key] = replicas.get(key, 0) + 1
        if key not in merged:
            merged[key] = _copy(m, labels)
        else:
            _add(merged[key], m)
    for key, m in merged.items():
        if isinstance(m, Gauge) and m.name.endswith(("_perc", "_info")):
            m.value /= replicas[key]
    return list(merged.values())


def _copy(m: Metric, labels: dict[str, str]) -> Metric:
    if isinstance(m, Histogram):
        return Histogram(name=m.name, labels=labels, count=m.count, sum=m.sum,
                         buckets=dict(m.buckets))
    if isinstance(m, Counter):
        return Counter(name=m.name, labels=labels, value=m.value)
    if isinstance(m, Gauge):
        return Gauge(name=m.name, labels=labels, value=m.value)
    raise TypeError(f"cannot aggregate a {type(m).__name__} ({m.name})")


def _add(total: Metric, m: Metric) -> None:
    if isinstance(total, Histogram) and isinstance(m, Histogram):
        total.count += m.count
        total.sum += m.sum
        for le, n in m.buckets.items():
            total.buckets[le] = total.buckets.get(le, 0) + n
    elif isinstance(total, Counter | Gauge) and type(m) is type(total):
        total.value += m.value  # type: ignore[attr-defined]
    else:
        raise TypeError(f"{m.name}: a {type(m).__name__} and a {type(total).__name__} "
                        f"share a name")
