"""The page filesystem's HTTP port: ``GET /metrics`` (Prometheus: the store's counters at
scrape time, the GetPage histograms of ``compute.pagefs.remote``), ``GET /v1/status`` and
``POST /v1/evict`` (drop every page the rules allow, and the kernel's cached relation pages:
tests and cold-read benchmarks) and ``POST /v1/pageserver {"pageserver": "host:port"}`` (read
from another page service from now on, when the tenant moved to another pageserver). Imported after the mount (``compute.pagefs.main``): nothing
here is needed before PostgreSQL starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyfuse3
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.http import HttpError, HttpServer, HttpServerConfig, Request, Response, Router
from common.metrics import add_metrics_route
from compute.pagefs.fs import PageFs
from compute.pagefs.store import Keep


class StoreCollector(Collector):
    """The page store's counters at scrape time."""

    def __init__(self, fs: PageFs) -> None:
        self.fs = fs

    def collect(self) -> Any:
        m = self.fs.store.metrics
        for name, value, doc in (
            ("pagefs_hits", m.hits, "blocks served from the local page file or known zeros"),
            ("pagefs_misses", m.misses, "blocks read from the page service"),
            ("pagefs_zero_reads", m.zero_reads, "blocks past the pageserver's size"),
            ("pagefs_writes", m.writes, "blocks written"),
            ("pagefs_evictions", m.evictions, "pages dropped from the local page file"),
            ("pagefs_over_capacity", m.over_capacity, "allocations past local_cache_size (all kept)"),
            ("pagefs_read_errors", self.fs.read_errors, "kernel reads answered EIO"),
            ("pagefs_getpage_reconnects", self.fs.fetcher.reconnects,
             "GetPage batches sent again on a new connection (the page service was unreachable)"),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("pagefs_bytes_cached", "bytes in the local page file")
        g.add_metric([], self.fs.store.bytes_cached)
        yield g
        k = GaugeMetricFamily("pagefs_kept_pages", "written pages that may not leave, by reason", labels=["reason"])
        for reason, n in self.fs.store.kept.items():
            if reason != Keep.NO:
                k.add_metric([reason.name.lower()], n)
        yield k


def build_http(fs: PageFs, registry: CollectorRegistry, port: int,
               status: Callable[[int | None], dict[str, object]]) -> HttpServer:
    """The server (not yet serving); ``status(port)`` is the ``/v1/status`` document."""
    registry.register(StoreCollector(fs))
    router = Router()
    add_metrics_route(router, registry)
    http = HttpServer(router, HttpServerConfig(port=port))

    async def status_route(_: Request) -> Response:
        return Response.json(status(http.port))

    async def evict_route(_: Request) -> Response:
        # The kernel's page cache forgets the relation files too, so that the next reads reach
        # the page service.
        evicted = fs.store.evict_all()
        for ino in fs.relation_inodes():
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
            except OSError:
                pass  # an inode the kernel never looked up has nothing cached
        return Response.json({"evicted": evicted})

    async def pageserver_route(req: Request) -> Response:
        body = req.json()
        addr = body.get("pageserver") if isinstance(body, dict) else None
        new_host, sep, new_port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
        if not sep or not new_host or not new_port.isdigit() or not 0 < int(new_port) < 65536:
            raise HttpError(400, f'want {{"pageserver": "host:port"}}, got {body!r}')
        await fs.fetcher.switch(new_host, int(new_port))
        return Response.json({"pageserver": f"{new_host}:{new_port}"})

    router.add("GET", "/v1/status", status_route)
    router.add("POST", "/v1/evict", evict_route)
    router.add("POST", "/v1/pageserver", pageserver_route)
    return http
