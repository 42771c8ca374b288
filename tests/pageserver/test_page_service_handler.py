"""The page service behind the real libpq server loop: our PageClient over memory streams, a
real libpq client (psycopg's ``pq`` layer) over TCP, query parsing, stream-ending errors."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg.pq
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from psycopg.pq.abc import PGconn, PGresult

from common.auth import JwtVerifier, Service
from common.pgauth import JwtAuthenticator
from common.pgclient import PgClientConnection
from common.pgserver import PgServer, PgServerConfig
from compute.page_client import PageClient, PageRequestFailed
from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining, SerialPipelining
from pageserver.page_service.handler import (
    OtherCommand,
    PageServiceHandler,
    PagestreamCommand,
    SetCommand,
    parse_query,
)
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.reader import NotFound, PageReader
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.pagestream import (
    BLCKSZ,
    ErrorResponse,
    GetPageRequest,
    GetPageResponse,
    RelTag,
    Response,
    SlruKind,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from protocol.pgwire.errors import PgError
from tests.auth_helpers import AuthKit
from tests.pageserver.page_service_fakes import ZERO_PAGE, FakeTimeline, page_image, slru_segment

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
OTHER = TimelineId(bytes(16))
REL = RelTag(1663, 5, 16384, 0)
MAX = Lsn(0xFFFF_FFFF_FFFF_FFFF)


class Lookup:
    def __init__(self, timelines: dict[tuple[TenantId, TimelineId], FakeTimeline]) -> None:
        self.timelines = timelines

    def get_reader(self, tenant_id: TenantId, timeline_id: TimelineId) -> PageReader:
        try:
            return self.timelines[(tenant_id, timeline_id)]
        except KeyError:
            raise NotFound(f"timeline {tenant_id}/{timeline_id} not found") from None


def make_timeline() -> FakeTimeline:
    tl = FakeTimeline(last_record_lsn=0x1000)
    tl.fill(REL, 10, [0x100, 0x800])
    tl.slru[(SlruKind.CLOG, 0)] = slru_segment(3)
    return tl


def make_server(tl: FakeTimeline, config: PageServiceConfig | None = None,
                auth: AuthKit | None = None, **kw: object) -> PgServer:
    """``auth``: JWTs required (docs/auth.md); ``connect_memory`` then sends a tenant token."""
    handler = PageServiceHandler(Lookup({(TENANT, TIMELINE): tl}), config, **kw)  # type: ignore[arg-type]
    authenticator = None
    if auth is not None:
        authenticator = JwtAuthenticator(JwtVerifier.from_key_path(auth.public_path), Service.PAGESERVER)
    return PgServer(handler, PgServerConfig(port=0, idle_timeout_s=None), authenticator=authenticator)


async def connect_memory(server: PgServer, nursery: trio.Nursery, auth: AuthKit | None = None) -> PgClientConnection:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    nursery.start_soon(server.serve_connection, server_stream)
    password = None if auth is None else auth.tenant(TENANT)
    return await PgClientConnection.open(client_stream, user="test", password=password)


@pytest.fixture(params=["trust", "jwt"])
def auth(request: pytest.FixtureRequest, tmp_path: Path) -> AuthKit | None:
    """The hostile-input tests run with and without auth on (the default)."""
    return AuthKit.create(tmp_path) if request.param == "jwt" else None


def test_parse_query() -> None:
    assert parse_query(f"pagestream_v3 {TENANT.hex} {TIMELINE.hex}") == PagestreamCommand(3, TENANT, TIMELINE)
    assert parse_query(f"  PAGESTREAM_V2   {TENANT.hex}\t{TIMELINE.hex} ") == PagestreamCommand(2, TENANT, TIMELINE)
    assert parse_query("set datestyle to ISO") == SetCommand("set datestyle to ISO")
    assert parse_query("basebackup a b") == OtherCommand("basebackup", ("a", "b"))
    for bad in ("pagestream_v3", "nonsense", f"pagestream_v3 {TENANT.hex}", "pagestream_v2 xx yy", ""):
        with pytest.raises(PgError):
            parse_query(bad)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize(
    "config",
    [PageServiceConfig(page_service_pipelining=SerialPipelining()), PageServiceConfig()],
    ids=["serial", "pipelined"],
)
async def test_page_client_over_the_server_loop(version: int, config: PageServiceConfig) -> None:
    tl = make_timeline()
    registry = CollectorRegistry()
    server = make_server(tl, config, metrics=PageServiceMetrics.register(registry))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn = await connect_memory(server, nursery)
            assert (await conn.query("set datestyle to 'ISO'")) == []
            client = await PageClient.start(conn, TENANT, TIMELINE, version=version)  # type: ignore[arg-type]
            assert await client.get_page(REL, 3) == page_image(REL, 3, 0x800)
            assert await client.get_page(REL, 3, Lsn(0x200), Lsn(0x200)) == page_image(REL, 3, 0x100)
            assert await client.get_page(REL, 50) == ZERO_PAGE
            assert await client.exists(REL) is True
            assert await client.nblocks(REL) == 10
            assert await client.db_size(5) == 10 * BLCKSZ
            assert await client.slru_segment(SlruKind.CLOG, 0) == slru_segment(3)
            with pytest.raises(PageRequestFailed, match="Bad request"):
                await client.get_page(RelTag(1663, 5, 0, 0), 1)
            requests = [
                GetPageRequest(client.next_reqid(), MAX, Lsn(0), REL, i % 10) for i in range(200)
            ]
            responses = await client.pipelined(requests, queue_depth=32)
            assert responses == [GetPageResponse(r, page_image(REL, r.blkno, 0x800)) for r in requests]
            await client.finish()  # CopyDone: back to query mode on the same connection
            assert (await conn.query("set x to 1")) == []
            await conn.aclose()
    batches = registry.get_sample_value("pageserver_page_service_batch_size_count")
    assert batches is not None and batches >= 1


async def test_missing_timeline() -> None:
    tl = make_timeline()
    server = make_server(tl)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            # A non-GetPage request: ErrorResponse XX000, and the connection stays usable.
            conn = await connect_memory(server, nursery)
            client = await PageClient.start(conn, TENANT, OTHER)  # opening never fails
            with pytest.raises(PgError) as info:
                await client.nblocks(REL)
            assert info.value.sqlstate == "XX000" and "not found" in info.value.message
            await conn.finish_copy()
            assert (await conn.query("set a to b")) == []
            await conn.aclose()
            # A GetPage: misrouted, FATAL 08006 "reconnect", connection closed.
            conn = await connect_memory(server, nursery)
            client = await PageClient.start(conn, TENANT, OTHER)
            with pytest.raises(PgError) as info:
                await client.get_page(REL, 1)
            assert info.value.sqlstate == "08006" and info.value.severity == "FATAL"
            await conn.aclose()


async def test_bad_message_ends_stream_but_not_connection(auth: AuthKit | None) -> None:
    tl = make_timeline()
    server = make_server(tl, auth=auth)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn = await connect_memory(server, nursery, auth)
            client = await PageClient.start(conn, TENANT, TIMELINE)
            good = GetPageRequest(1, MAX, Lsn(0), REL, 1)
            await client.copy.send(encode_request(good, 3))
            await client.copy.send(b"\x07garbage")
            first = await client.copy.receive()
            assert first is not None
            assert decode_response(first, 3, good) == GetPageResponse(good, page_image(REL, 1, 0x800))
            with pytest.raises(PgError) as info:
                await client.copy.receive()
            assert info.value.sqlstate == "XX000" and "invalid tag 7" in info.value.message
            await conn.finish_copy()
            assert (await conn.query("set a to b")) == []
            await conn.aclose()


async def test_timeline_shutdown_sends_57p01_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    tl.read_delay_s = 100.0  # requests are in flight when the timeline shuts down
    server = make_server(tl)
    async with trio.open_nursery() as nursery:
        conn = await connect_memory(server, nursery)
        client = await PageClient.start(conn, TENANT, TIMELINE)
        await client.send(*[GetPageRequest(i, MAX, Lsn(0), REL, i) for i in range(1, 9)])
        await trio.sleep(1)
        tl.shut_down()
        with trio.fail_after(1), pytest.raises(PgError) as info:
            await client.receive()
        assert info.value.sqlstate == "57P01" and info.value.severity == "FATAL"
        with trio.fail_after(1):
            assert await conn.transport.receive_some() == b""  # the server closed it
        await conn.aclose()


async def test_server_shutdown_ends_streams(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    tl.read_delay_s = 100.0
    server = make_server(tl)
    async with trio.open_nursery() as nursery:
        conn = await connect_memory(server, nursery)
        client = await PageClient.start(conn, TENANT, TIMELINE)
        await client.send(GetPageRequest(1, MAX, Lsn(0), REL, 1))
        await trio.sleep(1)
        server.shutdown()
        with trio.fail_after(1), pytest.raises(PgError) as info:
            await client.receive()
        assert info.value.sqlstate == "57P01"
        await conn.aclose()


# ---------------------------------------------------------------------------------------------
# A real libpq client over TCP


# psycopg's C pq layer keeps the GIL inside blocking libpq calls, which would freeze the trio
# server running in the main thread; so these drive libpq through its non-blocking API and
# sleep (releasing the GIL) between polls.
def _poll_connect(port: int) -> PGconn:
    conn = psycopg.pq.PGconn.connect_start(
        f"host=127.0.0.1 port={port} user=test dbname=x sslmode=disable gssencmode=disable".encode()
    )
    deadline = time.monotonic() + 30  # the trio server shares a loaded machine
    while (status := conn.connect_poll()) != psycopg.pq.PollingStatus.OK:
        assert status != psycopg.pq.PollingStatus.FAILED, conn.get_error_message()
        assert time.monotonic() < deadline, "libpq connect timed out"
        time.sleep(0.002)
    conn.nonblocking = 1
    return conn


def _poll_result(conn: PGconn) -> PGresult:
    deadline = time.monotonic() + 30
    while True:
        conn.consume_input()
        if not conn.is_busy():
            result = conn.get_result()
            assert result is not None
            return result
        assert time.monotonic() < deadline, "libpq query timed out"
        time.sleep(0.002)


def _poll_copy_data(conn: PGconn) -> tuple[int, bytes]:
    deadline = time.monotonic() + 30
    while True:
        conn.consume_input()
        n, data = conn.get_copy_data(1)
        if n != 0:
            return n, bytes(data)
        assert time.monotonic() < deadline, "libpq get_copy_data timed out"
        time.sleep(0.002)


def _put(conn: PGconn, payload: bytes) -> None:
    while conn.put_copy_data(payload) == 0:
        time.sleep(0.002)
    while conn.flush() != 0:
        time.sleep(0.002)


def _libpq_session(port: int, version: int) -> list[bytes]:
    """libpq itself (psycopg's pq layer): open pagestream, pipeline 3 GetPages, read them."""
    conn = _poll_connect(port)
    try:
        conn.send_query(f"pagestream_v{version} {TENANT.hex} {TIMELINE.hex}".encode())
        res = _poll_result(conn)
        assert res.status == psycopg.pq.ExecStatus.COPY_BOTH, res.error_message
        reqid = 0 if version == 2 else 1
        for blk in (0, 1, 2):
            req = GetPageRequest(reqid, MAX, Lsn(0), REL, blk)
            _put(conn, encode_request(req, version))  # type: ignore[arg-type]
        out = []
        for _ in range(3):
            n, data = _poll_copy_data(conn)
            assert n > 0, conn.get_error_message()
            out.append(data)
        return out
    finally:
        conn.finish()


def _libpq_garbage(port: int) -> bytes:
    conn = _poll_connect(port)
    try:
        conn.send_query(f"pagestream_v3 {TENANT.hex} {TIMELINE.hex}".encode())
        assert _poll_result(conn).status == psycopg.pq.ExecStatus.COPY_BOTH
        _put(conn, b"\xff\x00\x01")
        n, _ = _poll_copy_data(conn)
        assert n == -1  # the server ended COPY with an error
        result = _poll_result(conn)
        return result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) or b""
    finally:
        conn.finish()


@pytest.mark.parametrize("version", [2, 3])
async def test_real_libpq_client(version: int) -> None:
    tl = make_timeline()
    server = make_server(tl)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            payloads = await trio.to_thread.run_sync(_libpq_session, port, version)
            for blk, payload in enumerate(payloads):
                req = GetPageRequest(0 if version == 2 else 1, MAX, Lsn(0), REL, blk)
                response = decode_response(payload, version, req)  # type: ignore[arg-type]
                assert response == GetPageResponse(req, page_image(REL, blk, 0x800))
            # garbage on one connection ends that stream only; the server keeps serving
            assert await trio.to_thread.run_sync(_libpq_garbage, port) == b"XX000"
            payloads = await trio.to_thread.run_sync(_libpq_session, port, version)
            assert len(payloads) == 3
            server.shutdown()


async def test_hostile_connections_do_not_disturb_others(auth: AuthKit | None) -> None:
    tl = make_timeline()
    server = make_server(tl, PageServiceConfig(page_service_pipelining=PipelinedPipelining(8)), auth=auth)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            good = await connect_memory(server, nursery, auth)
            client = await PageClient.start(good, TENANT, TIMELINE)
            for garbage in (b"\x02" + b"\x00" * 5, b"\x63", b"\x00" * 10):
                bad = await connect_memory(server, nursery, auth)
                bad_client = await PageClient.start(bad, TENANT, TIMELINE)
                await bad_client.copy.send(garbage)
                with pytest.raises(PgError):
                    await bad_client.copy.receive()
                await bad.aclose()
                # relnode 0 and LSN 0 are per-request errors on the good connection
                r = await client.request(GetPageRequest(5, MAX, Lsn(0), RelTag(1663, 5, 0, 0), 1))
                assert isinstance(r, ErrorResponse) and "relnode" in r.message
                r = await client.request(GetPageRequest(6, Lsn(0), Lsn(0), REL, 1))
                assert isinstance(r, ErrorResponse) and "LSN(0)" in r.message
                assert await client.get_page(REL, 2) == page_image(REL, 2, 0x800)
            await good.aclose()




class LyingHandler:
    """Answers every GetPage with the response to a different request (wrong reqid)."""

    async def handle_query(self, conn: object, query: str) -> None:
        copy = await conn.enter_copy_both()  # type: ignore[attr-defined]
        while (payload := await copy.receive()) is not None:
            req = decode_request(payload, 3)
            assert isinstance(req, GetPageRequest)
            wrong = GetPageRequest(req.reqid + 1, req.request_lsn, req.not_modified_since, req.rel, req.blkno)
            await copy.send(encode_response(GetPageResponse(wrong, ZERO_PAGE), 3))


async def test_page_client_refuses_mismatched_v3_response() -> None:
    server = PgServer(LyingHandler(), PgServerConfig(port=0, idle_timeout_s=None))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn = await connect_memory(server, nursery)
            client = await PageClient.start(conn, TENANT, TIMELINE)
            with pytest.raises(RemoteProtocolError, match="does not answer"):
                await client.get_page(REL, 1)
            await conn.aclose()


async def test_page_client_pipelined_queue_depth() -> None:
    """At most queue_depth requests are ever in flight; all responses arrive in order."""
    tl = make_timeline()
    server = make_server(tl)
    seen_depths: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn = await connect_memory(server, nursery)
            client = await PageClient.start(conn, TENANT, TIMELINE)
            original_receive = client.receive

            async def spying_receive() -> Response:
                seen_depths.append(client.in_flight)
                return await original_receive()

            client.receive = spying_receive  # type: ignore[method-assign]
            requests = [GetPageRequest(client.next_reqid(), MAX, Lsn(0), REL, i % 10) for i in range(100)]
            responses = await client.pipelined(requests, queue_depth=4)
            assert [r.request for r in responses] == requests  # type: ignore[union-attr]
            await conn.aclose()
    assert max(seen_depths) <= 4 and max(seen_depths) > 1
