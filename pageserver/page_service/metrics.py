"""Page service metrics, registered on a caller-provided Prometheus registry.

- ``pageserver_page_service_batch_size``: requests per executed batch (GetPage batches and
  batches-of-one alike), the "batching factor" is its sum / count;
- ``pageserver_page_service_getpage_execution_seconds``: per GetPage, from the moment Execution
  took its batch until its response was written; time spent waiting in the batcher is excluded
  (neon#10075 counted it, which made batching look like latency);
- ``pageserver_page_service_time_in_batcher_seconds``: per request, from decoded to taken;
- ``pageserver_page_service_requests_total{type, outcome}``: outcome ``ok`` or ``error``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_go_float: Callable[[float], str] = floatToGoString  # prometheus_client's helper is untyped

BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 24, 32, 48, 64)
LATENCY_BUCKETS: Final = (
    0.00001,
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)


class FastHistogram:
    """A Prometheus histogram for one writer thread, with ``observe(value, n)``.

    ``prometheus_client.Histogram.observe`` takes two locks per call; the page service observes
    two histograms per GetPage from its single trio thread, and the whole GetPage budget of a
    cached page is a few tens of microseconds. Here an observation is a bisect and two adds; a
    scrape from another thread may see a sum one observation ahead of the buckets, which
    Prometheus tolerates. Exposition is identical (``_bucket{le}``, ``_count``, ``_sum``).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        if registry is not None:
            registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value``."""
        self._counts[bisect.bisect_left(self._bounds, value)] += n
        self._sum += value * n

    @property
    def count(self) -> int:
        return sum(self._counts)

    @property
    def sum(self) -> float:
        return self._sum

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, buckets = 0, []
        for bound, n in zip(self._bounds, self._counts, strict=True):
            cumulative += n
            buckets.append((_go_float(bound), cumulative))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=self._sum
        )

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)


class FastCounter:
    """A labelled Prometheus counter for one writer thread (same single-writer reasoning as
    ``FastHistogram``): ``prometheus_client.Counter`` takes a lock per ``inc`` and a lock and a
    tuple per ``labels()``. Exposes ``<name>_total{labels}`` like a ``Counter``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], int] = {}
        if registry is not None:
            registry.register(self)

    def inc(self, labels: tuple[str, ...], n: int = 1) -> None:
        values = self.values
        values[labels] = values.get(labels, 0) + n

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


_OUTCOME_KEYS: Final = {
    (request_type, ok): (request_type, "ok" if ok else "error")
    for request_type in ("exists", "nblocks", "get_page", "db_size", "get_slru_segment")
    for ok in (True, False)
}


@attrs.frozen
class PageServiceMetrics:
    batch_size: FastHistogram
    getpage_execution_seconds: FastHistogram
    time_in_batcher_seconds: FastHistogram
    requests: FastCounter

    def count(self, request_type: str, ok: bool, n: int = 1) -> None:
        """Add ``n`` requests of ``request_type`` with outcome ok/error."""
        key = _OUTCOME_KEYS.get((request_type, ok)) or (request_type, "ok" if ok else "error")
        self.requests.inc(key, n)

    @classmethod
    def register(cls, registry: CollectorRegistry) -> PageServiceMetrics:
        return cls(
            batch_size=FastHistogram(
                "pageserver_page_service_batch_size",
                "Requests per executed batch",
                BATCH_BUCKETS,
                registry,
            ),
            getpage_execution_seconds=FastHistogram(
                "pageserver_page_service_getpage_execution_seconds",
                "GetPage latency from batch start to response written, excluding batcher wait",
                LATENCY_BUCKETS,
                registry,
            ),
            time_in_batcher_seconds=FastHistogram(
                "pageserver_page_service_time_in_batcher_seconds",
                "Time from request decoded to its batch taken by Execution",
                LATENCY_BUCKETS,
                registry,
            ),
            requests=FastCounter(
                "pageserver_page_service_requests",
                "Pagestream requests by type and outcome",
                ["type", "outcome"],
                registry,
            ),
        )

    def batching_factor(self) -> float:
        """Mean batch size so far (benchmarks report it)."""
        count = self.batch_size.count
        return self.batch_size.sum / count if count else 0.0
