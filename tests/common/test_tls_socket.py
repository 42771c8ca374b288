"""common.tls_socket: the blocking TLS socket of ``BlockingPageClient`` (the benchmarks' load
driver): a receive returns every record already received; the server's certificate and host
name are verified; EOF with and without close_notify; a pagestream over it against the page
service with TLS and a tenant token."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from common.auth import JwtVerifier, Service
from common.pgauth import JwtAuthenticator
from common.pgserver import PgServer, PgServerConfig
from common.tls import client_context, server_context
from common.tls_socket import BlockingTlsSocket
from common.tls_stream import TlsStream
from compute.page_client import BlockingPageClient
from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining
from pageserver.page_service.handler import PageServiceHandler
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, GetPageResponse
from protocol.pgwire.errors import PgError
from tests.auth_helpers import AuthKit, TlsKit
from tests.pageserver.page_service_fakes import FakeTimeline, page_image
from tests.pageserver.test_page_service_handler import MAX, REL, TENANT, TIMELINE, Lookup

Session = Callable[[TlsStream], Awaitable[None]]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


async def _one_connection(
    tls: TlsKit, session: Session, errors: list[BaseException],
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A TLS server for one connection: the handshake, then ``session``; a failed handshake
    lands in ``errors``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    tcp = await listeners[0].accept()
    await listeners[0].aclose()
    assert isinstance(tcp, trio.SocketStream)
    stream = TlsStream(tcp, server_context(tls.cert, tls.key), server_side=True)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        errors.append(exc)
        await tcp.aclose()
        return
    await session(stream)


def _connect(port: int, ca: Path, host: str = "localhost") -> BlockingTlsSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = BlockingTlsSocket(sock, client_context(ca), host)
    try:
        tls.do_handshake()
    except BaseException:
        sock.close()
        raise
    return tls


async def test_receive_takes_every_buffered_record(tls: TlsKit) -> None:
    page = bytes(range(256)) * 32 * 8  # 64 KiB: several records

    async def session(stream: TlsStream) -> None:
        for i in range(10):
            await stream.send_all(b"record %d;" % i)  # one TLS record each
        assert await stream.receive_some(100) == b"go"
        await stream.send_all(page)
        await stream.aclose()  # close_notify

    def client(port: int) -> None:
        sock = _connect(port, tls.ca_cert)
        time.sleep(0.3)  # all ten records in the client's socket buffer
        buf = bytearray(1 << 20)
        n = sock.recv_into(buf)
        assert bytes(buf[:n]) == b"".join(b"record %d;" % i for i in range(10))
        sock.sendall(b"go")
        got = bytearray()
        while len(got) < len(page):
            n = sock.recv_into(buf, 5000)  # nbytes bounds one receive
            assert 0 < n <= 5000
            got += buf[:n]
        assert bytes(got) == page
        assert sock.recv_into(buf) == 0  # close_notify, then EOF
        assert sock.recv(10) == b""
        sock.close()

    errors: list[BaseException] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_one_connection, tls, session, errors)
            await trio.to_thread.run_sync(client, port)
    assert not errors


async def test_eof_without_close_notify_is_eof(tls: TlsKit) -> None:
    async def session(stream: TlsStream) -> None:
        await stream.send_all(b"bye")
        await stream.transport_stream.aclose()  # the socket closes, no close_notify

    def client(port: int) -> None:
        sock = _connect(port, tls.ca_cert)
        buf = bytearray(100)
        got = b""
        while (n := sock.recv_into(buf)) != 0:
            got += buf[:n]
        assert got == b"bye"
        sock.close()

    errors: list[BaseException] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_one_connection, tls, session, errors)
            await trio.to_thread.run_sync(client, port)
    assert not errors


@pytest.mark.parametrize("case", ["unknown-ca", "wrong-host"])
async def test_server_certificate_is_verified(tls: TlsKit, tmp_path: Path, case: str) -> None:
    """The handshake fails on the client, which tells the server why (an alert)."""
    ca = TlsKit.create(tmp_path).ca_cert if case == "unknown-ca" else tls.ca_cert
    host = "localhost" if case == "unknown-ca" else "not-this-node.example"

    async def session(stream: TlsStream) -> None:
        raise AssertionError("the handshake must fail")

    def client(port: int) -> None:
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            _connect(port, ca, host)
        assert ("unable to get local issuer" if case == "unknown-ca" else "Hostname mismatch") \
            in str(info.value)

    errors: list[BaseException] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_one_connection, tls, session, errors)
            await trio.to_thread.run_sync(client, port)
    assert errors
    assert ("unknown ca" if case == "unknown-ca" else "certificate") in str(errors[0])


def _pagestream_session(port: int, ca: Path, token: str, queue_depth: int) -> int:
    with BlockingPageClient.connect("localhost", port, TENANT, TIMELINE, password=token,
                                    ssl_context=client_context(ca)) as c:
        assert isinstance(c.sock, BlockingTlsSocket)
        blknos = [(i * 7) % 70 for i in range(200)]
        sent = 0

        def request() -> GetPageRequest:
            nonlocal sent
            sent += 1
            return GetPageRequest(c.next_reqid(), MAX, Lsn(0), REL, blknos[sent - 1])

        c.send(*[request() for _ in range(queue_depth)])
        got = 0
        while c.in_flight:
            response = c.receive()
            assert isinstance(response, GetPageResponse)
            blkno = response.request.blkno
            assert bytes(response.page) == (page_image(REL, blkno, 0x800) if blkno < 64 else bytes(8192))
            got += 1
            if sent < len(blknos):
                c.send(request())
        assert c.get_page(REL, 3, Lsn(0x200)) == page_image(REL, 3, 0x100)
        return got


async def test_pagestream_over_tls_with_a_token(tls: TlsKit, tmp_path: Path) -> None:
    kit = AuthKit.create(tmp_path)
    timeline = FakeTimeline(last_record_lsn=0x1000)
    timeline.fill(REL, 64, [0x100, 0x800])
    handler = PageServiceHandler(
        Lookup({(TENANT, TIMELINE): timeline}),
        PageServiceConfig(page_service_pipelining=PipelinedPipelining(8)),
    )
    server = PgServer(
        handler, PgServerConfig(port=0, idle_timeout_s=None),
        authenticator=JwtAuthenticator(JwtVerifier.from_key_path(kit.public_path), Service.PAGESERVER),
        ssl_context=server_context(tls.cert, tls.key),
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            for qd in (1, 16):
                got = await trio.to_thread.run_sync(
                    _pagestream_session, port, tls.ca_cert, kit.tenant(TENANT), qd
                )
                assert got == 200
            # The page service still checks the token over TLS.
            with pytest.raises(PgError) as info:
                await trio.to_thread.run_sync(
                    _pagestream_session, port, tls.ca_cert, kit.forged(TENANT), 1
                )
            assert info.value.sqlstate == "28P01"
            server.shutdown()
