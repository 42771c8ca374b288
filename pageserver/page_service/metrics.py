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

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram

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


@attrs.frozen
class PageServiceMetrics:
    batch_size: Histogram
    getpage_execution_seconds: Histogram
    time_in_batcher_seconds: Histogram
    requests: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> PageServiceMetrics:
        return cls(
            batch_size=Histogram(
                "pageserver_page_service_batch_size",
                "Requests per executed batch",
                buckets=BATCH_BUCKETS,
                registry=registry,
            ),
            getpage_execution_seconds=Histogram(
                "pageserver_page_service_getpage_execution_seconds",
                "GetPage latency from batch start to response written, excluding batcher wait",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            time_in_batcher_seconds=Histogram(
                "pageserver_page_service_time_in_batcher_seconds",
                "Time from request decoded to its batch taken by Execution",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            requests=Counter(
                "pageserver_page_service_requests",
                "Pagestream requests by type and outcome",
                ["type", "outcome"],
                registry=registry,
            ),
        )

    def batching_factor(self) -> float:
        """Mean batch size so far (benchmarks report it)."""
        count = sum_ = 0.0
        for metric in self.batch_size.collect():
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    sum_ = sample.value
        return sum_ / count if count else 0.0
