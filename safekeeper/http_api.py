"""The safekeeper's HTTP port: timeline status as JSON and Prometheus ``/metrics``.

Routes (on ``common.http``):
- ``GET /v1/status``: node id, ports, settings, number of timelines;
- ``GET /v1/timelines``: every timeline's status;
- ``GET /v1/tenant/{tenant_id}/timeline/{timeline_id}``: one timeline's status (term,
  flush_lsn, commit_lsn, term history, write statistics, replicas); 404 ``{"msg": ...}``
  when unknown;
- ``DELETE /v1/tenant/{tenant_id}/timeline/{timeline_id}``: delete a timeline (its
  connections and tasks stopped, its directory, and its WAL backup ``wal/<tenant>/<timeline>/``
  in remote storage) → ``{timelines, dir_existed, remote_objects_deleted}``; idempotent (a
  repeated request finishes a failed one);
- ``DELETE /v1/tenant/{tenant_id}``: the same for every timeline of the tenant
  (``wal/<tenant>/``);
- ``GET /metrics``: ``safekeeper_*`` metrics (per timeline: flush/commit LSN, term, write
  groups, messages, bytes, fsyncs, and the histogram of messages per write group; with WAL
  backup on: ``safekeeper_backup_lsn``, ``safekeeper_wal_backup_rank``, uploaded segments and
  bytes, adopted segments and failures).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from common.http import HttpError, HttpServer, HttpServerConfig, Request, Router
from common.metrics import add_metrics_route, new_registry
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from remote_storage.errors import RemoteStorageError

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from safekeeper.node import SafekeeperNode


class _TimelineCollector(Collector):
    """Reads the timelines' counters at scrape time (no per-message metric updates)."""

    def __init__(self, node: SafekeeperNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant_id", "timeline_id"]
        flush = GaugeMetricFamily("safekeeper_flush_lsn", "Record-aligned flushed WAL end", labels=labels)
        commit = GaugeMetricFamily("safekeeper_commit_lsn", "Committed WAL end", labels=labels)
        term = GaugeMetricFamily("safekeeper_term", "Current term", labels=labels)
        groups = CounterMetricFamily("safekeeper_write_groups", "Coalesced WAL write groups", labels=labels)
        msgs = CounterMetricFamily("safekeeper_proposer_messages", "Proposer messages processed", labels=labels)
        wbytes = CounterMetricFamily("safekeeper_write_bytes", "WAL bytes written", labels=labels)
        fsyncs = CounterMetricFamily("safekeeper_fsyncs", "WAL fdatasync calls", labels=labels)
        backup_lsn = GaugeMetricFamily(
            "safekeeper_backup_lsn", "WAL below it is in remote storage as whole segments", labels=labels
        )
        backup_rank = GaugeMetricFamily(
            "safekeeper_wal_backup_rank", "This node's place in the backup election (0 = elected)",
            labels=labels,
        )
        backup_up = CounterMetricFamily(
            "safekeeper_wal_backup_uploaded_segments", "WAL segments this node uploaded", labels=labels
        )
        backup_bytes = CounterMetricFamily(
            "safekeeper_wal_backup_uploaded_bytes", "WAL bytes this node uploaded", labels=labels
        )
        backup_adopted = CounterMetricFamily(
            "safekeeper_wal_backup_adopted_segments",
            "Segments found already in remote storage (a peer's, or this node's before a restart)",
            labels=labels,
        )
        backup_fail = CounterMetricFamily(
            "safekeeper_wal_backup_failures", "Failed WAL backup requests (each retried)", labels=labels
        )
        sizes = HistogramMetricFamily(
            "safekeeper_write_group_messages", "AppendRequests per write group", labels=labels
        )
        for tl in list(self.node.timelines.values()):
            lv = [tl.tenant_id.hex, tl.timeline_id.hex]
            acc = tl.acceptor
            st = tl.stats
            flush.add_metric(lv, acc.flush_lsn)
            commit.add_metric(lv, acc.commit_lsn)
            term.add_metric(lv, acc.term)
            groups.add_metric(lv, st.groups)
            msgs.add_metric(lv, st.messages)
            wbytes.add_metric(lv, st.bytes)
            fsyncs.add_metric(lv, st.fsyncs)
            b = tl.backup
            if b.enabled:
                backup_lsn.add_metric(lv, acc.backup_lsn)
                backup_rank.add_metric(lv, b.rank)
                backup_up.add_metric(lv, b.uploaded_segments)
                backup_bytes.add_metric(lv, b.uploaded_bytes)
                backup_adopted.add_metric(lv, b.adopted_segments)
                backup_fail.add_metric(lv, b.failures)
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip(st.group_buckets, st.group_counts, strict=True):
                cumulative += count
                buckets.append((str(bound), cumulative))
            buckets.append(("+Inf", st.groups))
            sizes.add_metric(lv, buckets, sum_value=st.appends_in_groups)
        yield from (flush, commit, term, groups, msgs, wbytes, fsyncs, sizes, backup_lsn,
                    backup_rank, backup_up, backup_bytes, backup_adopted, backup_fail)


async def _deleting(work: Awaitable[dict[str, object]]) -> dict[str, object]:
    try:
        return await work
    except (RemoteStorageError, OSError) as exc:
        # What was deleted stays deleted; the request can be repeated.
        raise HttpError(503, f"deletion not finished: {exc}") from None
    except trio.TooSlowError:
        raise HttpError(503, "the timeline's connections and tasks did not stop in time; retry") from None


def build_http_server(node: SafekeeperNode) -> HttpServer:
    router = Router()

    @router.route("GET", "/v1/status")
    async def status(_: Request) -> object:
        return node.status()

    @router.route("GET", "/v1/timelines")
    async def timelines(_: Request) -> object:
        return [tl.status() for tl in list(node.timelines.values())]

    @router.route("GET", "/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    async def timeline(req: Request) -> object:
        tl = node.find_timeline(req.params["tenant_id"], req.params["timeline_id"])
        if tl is None:
            raise HttpError(
                404, f"timeline {req.params['tenant_id']}/{req.params['timeline_id']} not found"
            )
        return tl.status()

    def ids(req: Request) -> tuple[TenantId, TimelineId | None]:
        try:
            tenant = TenantId.parse(req.params["tenant_id"])
            timeline = req.params.get("timeline_id")
            return tenant, None if timeline is None else TimelineId.parse(timeline)
        except RemoteProtocolError as exc:
            raise HttpError(400, str(exc)) from None

    @router.route("DELETE", "/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    async def delete_timeline(req: Request) -> object:
        tenant_id, timeline_id = ids(req)
        assert timeline_id is not None
        got = await _deleting(node.delete_timeline(tenant_id, timeline_id))
        if not got["timelines"] and not got["dir_existed"] and not got["remote_objects_deleted"]:
            raise HttpError(404, f"timeline {tenant_id}/{timeline_id} not found")
        return got

    @router.route("DELETE", "/v1/tenant/{tenant_id}")
    async def delete_tenant(req: Request) -> object:
        tenant_id, _ = ids(req)
        got = await _deleting(node.delete_tenant(tenant_id))
        if not got["timelines"] and not got["dir_existed"] and not got["remote_objects_deleted"]:
            raise HttpError(404, f"tenant {tenant_id} not found")
        return got

    node.security.add_reload_route(router)
    registry = new_registry()
    registry.register(_TimelineCollector(node))
    add_metrics_route(router, registry)
    host, port = node.cfg.http_addr
    return HttpServer(router, HttpServerConfig(host=host, port=port),
                      auth=node.security.http_auth, ssl_context=node.security.ssl_context)
