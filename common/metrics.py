"""Prometheus metrics: one registry per node, served as text at ``GET /metrics``.

Each node creates its registry with ``new_registry()`` and its metrics against it
(``prometheus_client.Counter("pageserver_getpage_total", "...", registry=registry)``), names
prefixed ``pageserver_`` / ``safekeeper_``. A per-node registry (not the global default) keeps
two nodes in one test process apart. ``add_metrics_route(router, registry)`` adds the route.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.http import Request, Response, Router

# Latency buckets in seconds, 50 µs .. ~10 s (GetPage is sub-millisecond when cached).
LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
)
# Batch-size buckets (pagestream batching, safekeeper write groups).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def metrics_text(registry: CollectorRegistry) -> bytes:
    return bytes(generate_latest(registry))


def add_metrics_route(router: Router, registry: CollectorRegistry) -> None:
    async def metrics(_: Request) -> Response:
        return Response(200, metrics_text(registry), CONTENT_TYPE_LATEST)

    router.add("GET", "/metrics", metrics)
