"""The page service reading and writing the TCP socket itself (``pipeline.DirectStreamIO``)
behind the real libpq server loop, driven by ``compute.page_client.BlockingPageClient``.

Over TCP the pagestream takes the connection's undecoded bytes from the libpq loop and gives
back whatever follows the end of the stream: requests, CopyDone and the next Query sent in one
segment must all be answered, in order. A bad request inside intact framing ends the stream
but not the connection; broken framing ends the connection with FATAL 08P01.
"""

from __future__ import annotations

import random
import struct

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pgclient import PgClientConnection
from common.pgserver import PgServer, PgServerConfig
from compute.page_client import BlockingPageClient, PageClient
from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining, SerialPipelining
from pageserver.page_service.handler import PageServiceHandler
from pageserver.page_service.pipeline import DirectStreamIO
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn
from protocol.pagestream import (
    ErrorResponse,
    GetPageRequest,
    GetPageResponse,
    RelTag,
    RequestStreamDecoder,
    StreamEnd,
    encode_request_into,
)
from protocol.pgwire import NEED_DATA, BackendDecoder
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError
from tests.pageserver.page_service_fakes import ZERO_PAGE, FakeTimeline, page_image
from tests.pageserver.test_page_service_handler import MAX, REL, TENANT, TIMELINE, Lookup

CONFIGS = [
    PageServiceConfig(page_service_pipelining=SerialPipelining()),
    PageServiceConfig(page_service_pipelining=PipelinedPipelining(1)),
    PageServiceConfig(page_service_pipelining=PipelinedPipelining(8)),
]
IDS = ["serial", "pipelined-1", "pipelined-8"]


def _timeline() -> FakeTimeline:
    tl = FakeTimeline(last_record_lsn=0x1000)
    tl.fill(REL, 64, [0x100, 0x800])
    return tl


def _server(config: PageServiceConfig) -> PgServer:
    handler = PageServiceHandler(Lookup({(TENANT, TIMELINE): _timeline()}), config)
    return PgServer(handler, PgServerConfig(port=0, idle_timeout_s=None))


def _blocking_session(port: int, version: int, queue_depth: int) -> list[tuple[int, bytes]]:
    """``queue_depth`` requests in flight at a time, 200 in all: (blkno, page) per response."""
    rng = random.Random(version * 100 + queue_depth)
    out: list[tuple[int, bytes]] = []
    with BlockingPageClient.connect("127.0.0.1", port, TENANT, TIMELINE, version=version) as c:  # type: ignore[arg-type]

        def request() -> GetPageRequest:
            return GetPageRequest(c.next_reqid(), MAX, Lsn(0), REL, rng.randrange(70))

        c.send(*[request() for _ in range(queue_depth)])
        sent = queue_depth
        while c.in_flight:
            response = c.receive()
            assert isinstance(response, GetPageResponse)
            out.append((response.request.blkno, bytes(response.page)))
            if sent < 200:
                c.send(request())
                sent += 1
        assert c.get_page(REL, 3, Lsn(0x200)) == page_image(REL, 3, 0x100)
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("version", [2, 3])
async def test_blocking_client_over_tcp(config: PageServiceConfig, version: int) -> None:
    server = _server(config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            for qd in (1, 16):
                got = await trio.to_thread.run_sync(_blocking_session, port, version, qd)
                assert len(got) == 200
                for blkno, page in got:
                    assert page == (page_image(REL, blkno, 0x800) if blkno < 64 else ZERO_PAGE)
            server.shutdown()


def _one_segment_session(port: int, tail: bytes, ready: int) -> list[object]:
    """Open a v3 pagestream, then send 3 GetPages + ``tail`` in one segment; every message the
    server sends back until the ``ready``-th ReadyForQuery or until it closes."""
    c = BlockingPageClient.connect("127.0.0.1", port, TENANT, TIMELINE)
    try:
        out = bytearray()
        for i in range(3):
            encode_request_into(out, GetPageRequest(i + 1, MAX, Lsn(0), REL, i), 3, framed=True)
        c.sock.sendall(bytes(out) + tail)
        c.sock.settimeout(10.0)
        decoder = BackendDecoder()
        messages: list[object] = []
        while sum(isinstance(msg, m.ReadyForQuery) for msg in messages) < ready:
            msg = decoder.next_event()
            if msg is NEED_DATA:
                data = c.sock.recv(1 << 16)
                if not data:
                    break
                decoder.receive_data(data)
                continue
            messages.append(msg)
        return messages
    finally:
        c.close()


def _copy_pages(messages: list[object]) -> list[bytes]:
    return [bytes(msg.data) for msg in messages if isinstance(msg, m.CopyData)]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
async def test_bytes_after_copydone_go_back_to_the_libpq_loop(config: PageServiceConfig) -> None:
    server = _server(config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            tail = m.encode(m.CopyDone(), m.Query("set a to b"))
            got = await trio.to_thread.run_sync(_one_segment_session, port, tail, 2)
            assert len(_copy_pages(got)) == 3
            rest = [type(msg).__name__ for msg in got if not isinstance(msg, m.CopyData)]
            assert rest == [
                "CopyDone",
                "CommandComplete",
                "ReadyForQuery",
                "CommandComplete",
                "ReadyForQuery",
            ]
            assert [msg.tag for msg in got if isinstance(msg, m.CommandComplete)] == ["COPY", "SELECT 1"]
            server.shutdown()


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
async def test_bad_request_over_tcp_keeps_the_connection(config: PageServiceConfig) -> None:
    server = _server(config)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            garbage = b"d" + struct.pack(">I", 4 + 3) + b"\x07xx"  # CopyData, unknown tag 7
            tail = garbage + m.encode(m.CopyDone(), m.Query("set a to b"))
            got = await trio.to_thread.run_sync(_one_segment_session, port, tail, 2)
            assert len(_copy_pages(got)) == 3  # answered before the bad one
            errors = [msg for msg in got if isinstance(msg, m.ErrorResponse)]
            assert len(errors) == 1 and errors[0].sqlstate == "XX000"
            assert "invalid tag 7" in errors[0].message and errors[0].severity == "ERROR"
            # the stray CopyDone is skipped, the query after it is answered
            assert [msg.tag for msg in got if isinstance(msg, m.CommandComplete)] == ["SELECT 1"]
            assert isinstance(got[-1], m.ReadyForQuery)
            server.shutdown()


async def test_broken_framing_over_tcp_is_fatal() -> None:
    server = _server(CONFIGS[2])
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            tail = b"d" + struct.pack(">I", 2)  # a length that cannot be
            got = await trio.to_thread.run_sync(_one_segment_session, port, tail, 99)
            assert len(_copy_pages(got)) == 3
            errors = [msg for msg in got if isinstance(msg, m.ErrorResponse)]
            assert len(errors) == 1
            assert errors[0].sqlstate == "08P01" and errors[0].severity == "FATAL"
            server.shutdown()


async def test_blocking_client_reports_server_errors() -> None:
    server = _server(CONFIGS[1])
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)

            def session() -> tuple[object, str]:
                with BlockingPageClient.connect("127.0.0.1", port, TENANT, TIMELINE) as c:
                    c.send(GetPageRequest(c.next_reqid(), Lsn(0), Lsn(0), REL, 1))
                    per_request = c.receive()
                    c.sock.sendall(b"d" + struct.pack(">I", 4 + 1) + b"\x09")
                    c.send(GetPageRequest(c.next_reqid(), MAX, Lsn(0), REL, 1))
                    with pytest.raises(PgError) as info:
                        c.receive()
                    return per_request, info.value.sqlstate

            per_request, sqlstate = await trio.to_thread.run_sync(session)
            assert isinstance(per_request, ErrorResponse) and "LSN(0)" in per_request.message
            assert sqlstate == "XX000"
            server.shutdown()


# --- DirectStreamIO's decoding is RequestStreamDecoder's, fast path or not ---------------------

_FRAMES = st.one_of(
    # well-formed GetPages (the fast path), other requests, Flush/Sync, and junk
    st.builds(
        lambda reqid, lsn, blk, spc: ("getpage", reqid, lsn, blk, spc),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
    ),
    st.sampled_from([b"H\x00\x00\x00\x04", b"S\x00\x00\x00\x04", b"c\x00\x00\x00\x04"]),
    st.binary(min_size=0, max_size=60).map(lambda b: b"d" + struct.pack(">I", len(b) + 4) + b),
    st.binary(min_size=1, max_size=12),
)


def _frame_bytes(frame: object, version: int) -> bytes:
    if isinstance(frame, bytes):
        return frame
    assert isinstance(frame, tuple)
    _, reqid, lsn, blk, spc = frame
    out = bytearray()
    request = GetPageRequest(reqid if version == 3 else 0, Lsn(lsn), Lsn(lsn // 3), RelTag(spc, 5, 7, 0), blk)
    encode_request_into(out, request, version, framed=True)  # type: ignore[arg-type]
    return bytes(out)


def _oracle(data: bytes, version: int) -> list[object]:
    decoder = RequestStreamDecoder(version)  # type: ignore[arg-type]
    decoder.receive_data(data)
    decoder.receive_data(b"")
    out: list[object] = []
    try:
        while True:
            event = decoder.next_event()
            out.append(event)
            if isinstance(event, StreamEnd):
                return out
    except RemoteProtocolError as exc:
        return [*out, (exc.msg, exc.sqlstate)]


async def _direct(chunks: list[bytes], version: int) -> list[object]:
    client, server = trio.testing.memory_stream_pair()
    io = DirectStreamIO(server, version, chunks[0] if chunks else b"")  # type: ignore[arg-type]
    for chunk in chunks[1:]:
        await client.send_all(chunk)
    await client.send_eof()
    out: list[object] = []
    try:
        while True:
            event = await io.receive()
            out.append(event)
            if isinstance(event, StreamEnd):
                return out
    except RemoteProtocolError as exc:
        return [*out, (exc.msg, exc.sqlstate)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([2, 3]), st.lists(_FRAMES, max_size=12), st.lists(st.integers(0, 400), max_size=6))
def test_direct_decoding_matches_the_protocol_decoder(
    version: int, frames: list[object], cuts: list[int]
) -> None:
    data = b"".join(_frame_bytes(f, version) for f in frames)
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    chunks = [chunks[0], *(c for c in chunks[1:] if c)]
    assert trio.run(_direct, chunks, version) == _oracle(data, version)


async def test_idle_pagestream_is_closed_with_57p05(autojump_clock: trio.testing.MockClock) -> None:
    """The libpq loop's idle timeout still applies while the pagestream reads the socket."""
    handler = PageServiceHandler(Lookup({(TENANT, TIMELINE): _timeline()}), CONFIGS[2])
    server = PgServer(handler, PgServerConfig(port=0, idle_timeout_s=30))
    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, server_stream)
        conn = await PgClientConnection.open(client_stream, user="test")
        client = await PageClient.start(conn, TENANT, TIMELINE)
        assert await client.get_page(REL, 1) == page_image(REL, 1, 0x800)
        await trio.sleep(20)  # less than the timeout: still served
        assert await client.get_page(REL, 2) == page_image(REL, 2, 0x800)
        start = trio.current_time()
        with trio.fail_after(100), pytest.raises(PgError) as info:
            await client.copy.receive()
        assert info.value.sqlstate == "57P05" and info.value.severity == "FATAL"
        assert 29 <= trio.current_time() - start <= 31


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("busy", ["waits-for-lsn", "executes"])
async def test_idle_timeout_never_fires_while_a_request_is_in_flight(
    autojump_clock: trio.testing.MockClock, config: PageServiceConfig, busy: str
) -> None:
    """Idle means nothing in flight: in pipelined mode the reader is parked on the socket while
    Execution waits for WAL or reads, and that must not count as the client being idle."""
    tl = _timeline()
    if busy == "executes":
        tl.read_delay_s = 45.0
    handler = PageServiceHandler(Lookup({(TENANT, TIMELINE): tl}), config)
    server = PgServer(handler, PgServerConfig(port=0, idle_timeout_s=30))
    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, server_stream)
        conn = await PgClientConnection.open(client_stream, user="test")
        client = await PageClient.start(conn, TENANT, TIMELINE)
        start = trio.current_time()
        if busy == "waits-for-lsn":

            async def advance() -> None:
                await trio.sleep(45)
                tl.advance(0x2000)

            nursery.start_soon(advance)
            assert await client.get_page(REL, 1, Lsn(0x2000)) == page_image(REL, 1, 0x800)
        else:
            assert await client.get_page(REL, 1) == page_image(REL, 1, 0x800)
        answered = trio.current_time()
        assert answered - start >= 45
        # Idle from the answer on: 57P05 30 s later, not at once.
        with trio.fail_after(100), pytest.raises(PgError) as info:
            await client.copy.receive()
        assert info.value.sqlstate == "57P05"
        assert 29 <= trio.current_time() - answered <= 31
