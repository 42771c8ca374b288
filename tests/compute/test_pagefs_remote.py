"""The page filesystem's GetPage pool (``compute.pagefs.remote``) when the page service goes
away: a lost connection is retried on a new one until ``reconnect_timeout_s`` (a restarting
pageserver is a pause for the compute, not an I/O error), and then, or for a refusal that is
no lost connection, the read fails with ``PageFetchError`` (EIO)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from compute.page_client import PageClient
from compute.pagefs.page_header import make_page
from compute.pagefs.remote import PageFetcher, PageFetchError
from compute.pagefs.store import RemoteRead
from protocol.ids import TenantId, TimelineId
from protocol.lsn import MAX_LSN, Lsn
from protocol.pagestream import GetPageRequest, GetPageResponse, RelTag
from protocol.pgwire.errors import PgError

S = Lsn(0x0300_0000)
REL = RelTag(1663, 5, 16384, 0)
READS = [RemoteRead(b, b, MAX_LSN, S) for b in (3, 4)]


class FakeClient:
    """A connection to a fake page service: serves each GetPage, or breaks after sending."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.sent: list[GetPageRequest] = []
        self.answered: list[GetPageRequest] = []
        self.closed = False
        self._id = 0

    def next_reqid(self) -> int:
        self._id += 1
        return self._id

    async def send(self, *requests: GetPageRequest) -> None:
        self.sent.extend(requests)

    async def receive(self) -> GetPageResponse:
        await trio.lowlevel.checkpoint()
        if self.broken:
            raise trio.BrokenResourceError("server closed the connection")
        req = self.sent.pop(0)
        self.answered.append(req)
        return GetPageResponse(req, make_page(S - 8, fill=req.blkno))

    async def aclose(self) -> None:
        self.closed = True


def fetcher_with(connect: Callable[[], FakeClient], timeout: float) -> PageFetcher:
    f = PageFetcher("127.0.0.1", 1, TenantId(bytes(16)), TimelineId(bytes(16)), reconnect_timeout_s=timeout)

    async def client() -> PageClient:
        await trio.lowlevel.checkpoint()
        return connect()  # type: ignore[return-value]

    f._client = client  # type: ignore[method-assign]
    return f


async def test_a_lost_connection_is_retried_on_a_new_one() -> None:
    clients: list[FakeClient] = []
    outcomes = iter(["broken", "refused", "refused", "ok"])

    def connect() -> FakeClient:
        what = next(outcomes)
        if what == "refused":
            raise ConnectionRefusedError(111, "Connection refused")  # the pageserver restarting
        clients.append(FakeClient(broken=what == "broken"))
        return clients[-1]

    f = fetcher_with(connect, timeout=10)
    started = trio.current_time()
    pages = await f.fetch(REL, READS)
    assert pages == [make_page(S - 8, fill=3), make_page(S - 8, fill=4)]
    assert f.reconnects == 3 and f.batches == 1 and clients[0].closed
    # the same requests again: the LSNs the rules chose are not changed by a retry
    assert [(r.blkno, r.request_lsn, r.not_modified_since) for r in clients[-1].answered] == [
        (3, MAX_LSN, S), (4, MAX_LSN, S)]
    assert trio.current_time() - started < 5


async def test_the_read_fails_once_the_page_service_stays_away() -> None:
    def connect() -> FakeClient:
        raise ConnectionRefusedError(111, "Connection refused")

    f = fetcher_with(connect, timeout=0.5)
    started = trio.current_time()
    with pytest.raises(PageFetchError, match="Connection refused"):
        await f.fetch(REL, READS)
    assert 0.5 <= trio.current_time() - started < 3 and f.reconnects >= 2


@pytest.mark.parametrize("refusal", [
    PgError("tenant not found", "XX000"),
    PgError("password authentication failed", "28P01"),
])
async def test_a_refusal_is_no_lost_connection_and_fails_at_once(refusal: PgError) -> None:
    def connect() -> FakeClient:
        raise refusal

    f = fetcher_with(connect, timeout=30)
    with pytest.raises(PageFetchError):
        await f.fetch(REL, READS)
    assert f.reconnects == 0
