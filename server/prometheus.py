"""Prometheus text exposition (format 0.0.4), written here: prometheus_client is not a dependency.

Counters and histograms live in memory for the life of the process; everything that is a current
state (queue depth, health) is read when scraped and handed to ``render`` as gauge samples.
Not thread-safe on purpose: the gateway updates them from its one event loop.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in labels) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {_escape(help_text)}", f"# TYPE {name} {kind}"]


@dataclass
class Counter:
    name: str  # without the _total suffix, which the exposition adds
    help: str
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = _header(f"{self.name}_total", "counter", self.help)
        lines += [f"{self.name}_total{_labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]
        return lines


@dataclass
class _Series:
    buckets: list[int]
    count: int = 0
    total: float = 0.0


@dataclass
class Histogram:
    name: str
    help: str
    bounds: Sequence[float]  # upper bounds, ascending; +Inf is implied
    series: dict[Labels, _Series] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series([0] * len(self.bounds))
        index = bisect_left(self.bounds, value)  # the first bound >= value: "le" is inclusive
        if index < len(self.bounds):
            series.buckets[index] += 1
        series.count += 1
        series.total += value

    def render(self) -> list[str]:
        lines = _header(self.name, "histogram", self.help)
        for key, series in sorted(self.series.items()):
            cumulative = 0
            for bound, hits in zip(self.bounds, series.buckets, strict=True):
                cumulative += hits
                lines.append(f"{self.name}_bucket{_labels((*key, ('le', _number(bound))))} {cumulative}")
            lines.append(f"{self.name}_bucket{_labels((*key, ('le', '+Inf')))} {series.count}")
            lines.append(f"{self.name}_sum{_labels(key)} {_number(series.total)}")
            lines.append(f"{self.name}_count{_labels(key)} {series.count}")
        return lines


def gauge(name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A gauge read at scrape time."""
    return [*_header(name, "gauge", help_text), *(f"{name}{_labels(k)} {_number(v)}" for k, v in samples)]


def render(*blocks: list[str]) -> bytes:
    return ("\n".join(line for block in blocks for line in block) + "\n").encode()
