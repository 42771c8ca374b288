"""The safekeeper's HTTP port: timeline status as JSON and Prometheus ``/metrics``.

Routes (GET only):
- ``/v1/status``: node id, ports, number of timelines;
- ``/v1/timelines``: every timeline's status;
- ``/v1/tenant/{tenant_id}/timeline/{timeline_id}``: one timeline's status (term,
  flush_lsn, commit_lsn, term history, write statistics, replicas), 404 ``{"msg": ...}``
  when unknown;
- ``/metrics``: ``safekeeper_*`` metrics in the Prometheus text format.

A deliberately small HTTP/1.1 server (one request per connection, ``Connection: close``):
the safekeeper serves a handful of monitoring requests, not traffic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from safekeeper.node import SafekeeperNode

log = structlog.get_logger("safekeeper.http")

MAX_HEAD = 16 * 1024


class _TimelineCollector(Collector):
    def __init__(self, node: SafekeeperNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant_id", "timeline_id"]
        flush = GaugeMetricFamily("safekeeper_flush_lsn", "record-aligned flushed WAL end", labels=labels)
        commit = GaugeMetricFamily("safekeeper_commit_lsn", "committed WAL end", labels=labels)
        term = GaugeMetricFamily("safekeeper_term", "current term", labels=labels)
        groups = CounterMetricFamily("safekeeper_write_groups", "coalesced WAL write groups", labels=labels)
        msgs = CounterMetricFamily("safekeeper_write_messages", "proposer messages processed", labels=labels)
        wbytes = CounterMetricFamily("safekeeper_write_bytes", "WAL bytes written", labels=labels)
        fsyncs = CounterMetricFamily("safekeeper_fsyncs", "WAL fdatasync calls", labels=labels)
        for tl in self.node.timelines.values():
            lv = [tl.tenant_id.hex, tl.timeline_id.hex]
            acc = tl.acceptor
            flush.add_metric(lv, acc.flush_lsn)
            commit.add_metric(lv, acc.commit_lsn)
            term.add_metric(lv, acc.term)
            groups.add_metric(lv, tl.stats.groups)
            msgs.add_metric(lv, tl.stats.messages)
            wbytes.add_metric(lv, tl.stats.bytes)
            fsyncs.add_metric(lv, tl.stats.fsyncs)
        yield from (flush, commit, term, groups, msgs, wbytes, fsyncs)


class HttpApi:
    def __init__(self, node: SafekeeperNode) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.registry.register(_TimelineCollector(node))

    def route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return _json(405, {"msg": f"method {method} not allowed"})
        parts = [p for p in path.split("?", 1)[0].split("/") if p]
        if parts == ["metrics"]:
            return 200, "text/plain; version=0.0.4", generate_latest(self.registry)
        if parts == ["v1", "status"]:
            return _json(200, self.node.status())
        if parts == ["v1", "timelines"]:
            return _json(200, [tl.status() for tl in self.node.timelines.values()])
        if len(parts) == 5 and parts[:2] == ["v1", "tenant"] and parts[3] == "timeline":
            tl = self.node.find_timeline(parts[2], parts[4])
            if tl is None:
                return _json(404, {"msg": f"timeline {parts[2]}/{parts[4]} not found"})
            return _json(200, tl.status())
        return _json(404, {"msg": f"no route for {path}"})

    async def handle(self, stream: trio.abc.Stream) -> None:
        try:
            with trio.move_on_after(10):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    head += data
                    if len(head) > MAX_HEAD:
                        await _send(stream, *_json(431, {"msg": "request head too large"}))
                        return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                fields = request_line.split(" ")
                if len(fields) != 3:
                    await _send(stream, *_json(400, {"msg": "bad request line"}))
                    return
                status, ctype, body = self.route(fields[0], fields[1])
                await _send(stream, status, ctype, body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        task_status.started(bound)
        await trio.serve_listeners(self.handle, listeners)


def _json(status: int, value: object) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(value).encode()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}


async def _send(stream: trio.abc.Stream, status: int, ctype: str, body: bytes) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    await stream.send_all(head.encode() + body)


Route = Callable[[str, str], tuple[int, str, bytes]]
