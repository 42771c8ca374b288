"""GetPage for the page filesystem: a small pool of pagestream connections to the page
service. One kernel read becomes one batch: every GetPage of it is sent in one write on one
connection and the responses are read back in order, so the page service's pipeline folds the
16 GetPages of a 128 KiB readahead into one batch. Several kernel reads in flight use several
connections.

``switch`` moves the pool to another page service (a tenant migrated to another pageserver):
idle connections are closed, those in flight finish their batch and are closed when they come
back, and every later batch connects to the new address.

A connection that fails is dropped with every idle one (a restarted page service closed them
all) and the batch is sent again on a new connection, with a growing pause, for up to
``reconnect_timeout_s`` (PostgreSQL's read waits meanwhile, as on a slow disk): a pageserver
that restarts costs the compute a pause, not an error. Past that, or for an error that is not
the connection's (the page service refusing the stream: auth, an unknown timeline), the read
fails with ``PageFetchError``: the filesystem answers EIO, PostgreSQL reports an I/O error. An FSM page
the page service cannot serve is zeros (FSM pages are hints, rule R5); any other per-request
error is the read's error.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import structlog
import trio
from prometheus_client import CollectorRegistry, Histogram

from common.pgclient import connect_with_params
from compute.page_client import PageClient
from compute.pagefs.names import FSM
from compute.pagefs.page_header import ZERO_PAGE
from compute.pagefs.store import RemoteRead
from protocol.ids import TenantId, TimelineId
from protocol.pagestream import ErrorResponse, GetPageRequest, GetPageResponse, RelTag
from protocol.pgwire.errors import PgError

log = structlog.get_logger("compute.pagefs.remote")

BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS: Final = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0)


RECONNECT_TIMEOUT_S: Final = 60.0


class PageFetchError(Exception):
    """A GetPage batch failed (connection lost for too long, or the page service refused a page)."""


def _connection_lost(exc: Exception) -> bool:
    """A failure of the connection, not an answer: worth a new connection."""
    if isinstance(exc, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
        return True
    # 08: connection exception; 57P: the server shutting down or starting
    return isinstance(exc, PgError) and exc.sqlstate.startswith(("08", "57P"))


class PageFetcher:
    def __init__(
        self,
        host: str,
        port: int,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        *,
        connections: int = 4,
        token: str | None = None,
        ca_file: str | None = None,
        registry: CollectorRegistry | None = None,
        reconnect_timeout_s: float = RECONNECT_TIMEOUT_S,
    ) -> None:
        self.host, self.port = host, port
        self.tenant_id, self.timeline_id = tenant_id, timeline_id
        # libpq keywords for common.pgclient.connect_with_params: the token as password, TLS
        # verified against the cluster's CA
        self.params = {"user": "pagestore", **({"password": token} if token else {}),
                       **({"sslrootcert": ca_file} if ca_file else {})}
        self._idle: list[PageClient] = []
        # Bumped by ``switch``: a connection opened before it goes to the old page service.
        self._epoch = 0
        self._epoch_of: dict[int, int] = {}
        self._slots = trio.Semaphore(connections)
        reg = registry or CollectorRegistry()
        self.batch_size = Histogram("pagefs_getpage_batch_size", "GetPages sent per kernel read",
                                    buckets=BATCH_BUCKETS, registry=reg)
        self.latency = Histogram("pagefs_getpage_batch_seconds",
                                 "time from sending a kernel read's GetPages to its last page",
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.reconnect_timeout_s = reconnect_timeout_s
        self.batches = 0
        self.pages = 0
        self.errors = 0
        self.reconnects = 0  # batches sent again on a new connection

    async def _client(self) -> PageClient:
        if self._idle:
            return self._idle.pop()
        epoch = self._epoch
        conn = await connect_with_params(self.host, self.port, self.params)
        try:
            client = await PageClient.start(conn, self.tenant_id, self.timeline_id, version=3)
        except BaseException:
            await conn.aclose()
            raise
        self._epoch_of[id(client)] = epoch
        return client

    async def _release(self, client: PageClient) -> None:
        if self._epoch_of.get(id(client)) == self._epoch:
            self._idle.append(client)
            return
        self._epoch_of.pop(id(client), None)
        with trio.CancelScope(shield=True):
            await client.aclose()

    async def switch(self, host: str, port: int) -> None:
        """Fetch from the page service at ``host:port`` from now on."""
        log.info("page service moved", old=f"{self.host}:{self.port}", new=f"{host}:{port}")
        self.host, self.port = host, port
        self._epoch += 1
        idle, self._idle = self._idle, []
        for client in idle:
            self._epoch_of.pop(id(client), None)
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def fetch(self, rel: RelTag, reads: Sequence[RemoteRead]) -> list[bytes | memoryview]:
        """The pages of ``reads`` (one batch), in order: views into the response messages (no
        copy; the caller copies each once, into the kernel's read buffer)."""
        if not reads:
            return []
        async with self._slots:
            started = time.monotonic()
            deadline: float | None = None
            pause = 0.05
            while True:
                client: PageClient | None = None
                try:
                    client = await self._client()
                    requests = [GetPageRequest(client.next_reqid(), r.request_lsn, r.not_modified_since, rel,
                                               r.blkno) for r in reads]
                    await client.send(*requests)
                    responses = [await client.receive() for _ in requests]
                    break
                except Exception as exc:  # a lost connection, a refused stream
                    self.errors += 1
                    with trio.CancelScope(shield=True):
                        if client is not None:
                            self._epoch_of.pop(id(client), None)
                            await client.aclose()
                        await self._drop_idle()  # they went with the same page service
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.reconnect_timeout_s
                    if not _connection_lost(exc) or now >= deadline:
                        log.error("getpage batch failed", rel=str(rel), blocks=len(reads), error=str(exc))
                        raise PageFetchError(f"GetPage of {rel} blocks {reads[0].blkno}..: {exc}") from exc
                    self.reconnects += 1
                    log.warning("getpage connection lost, sending the batch again", rel=str(rel),
                                blocks=len(reads), error=str(exc), retry_in_s=pause)
                    await trio.sleep(min(pause, deadline - now))
                    pause = min(pause * 2, 1.0)
            await self._release(client)
            self.batches += 1
            self.pages += len(reads)
            self.batch_size.observe(len(reads))
            self.latency.observe(time.monotonic() - started)
        out: list[bytes | memoryview] = []
        for r, resp in zip(reads, responses, strict=True):
            if isinstance(resp, GetPageResponse):
                out.append(resp.page)
            elif isinstance(resp, ErrorResponse) and rel.forknum == FSM:
                out.append(ZERO_PAGE)
            elif isinstance(resp, ErrorResponse):
                self.errors += 1
                raise PageFetchError(f"GetPage of {rel} block {r.blkno}: {resp.message}")
            else:
                raise PageFetchError(f"GetPage of {rel} block {r.blkno}: unexpected {type(resp).__name__}")
        return out

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for client in idle:
            self._epoch_of.pop(id(client), None)
            await client.aclose()

    async def aclose(self) -> None:
        for client in self._idle:
            with trio.CancelScope(shield=True):
                await client.aclose()
        self._idle.clear()
        self._epoch_of.clear()
