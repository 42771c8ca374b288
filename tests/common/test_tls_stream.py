"""common.tls_stream: a receive returns every TLS record already received; handshake, EOF."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from common.tls import client_context, server_context
from common.tls_stream import TlsStream
from tests.auth_helpers import TlsKit


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


async def _pair(tls: TlsKit, ca: Path) -> tuple[TlsStream, TlsStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    client_sock = await trio.testing.open_stream_to_socket_listener(listeners[0])
    server_sock = await listeners[0].accept()
    await listeners[0].aclose()
    assert isinstance(client_sock, trio.SocketStream) and isinstance(server_sock, trio.SocketStream)
    server = TlsStream(server_sock, server_context(tls.cert, tls.key), server_side=True)
    client = TlsStream(client_sock, client_context(ca), server_side=False, server_hostname="127.0.0.1")
    return server, client


async def test_receive_drains_every_buffered_record(tls: TlsKit) -> None:
    with trio.fail_after(10):
        server, client = await _pair(tls, tls.ca_cert)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.do_handshake)
            await client.do_handshake()
        for i in range(10):
            await client.send_all(b"request %d;" % i)  # one TLS record each
        await trio.sleep(0.2)  # all of them in the server's socket buffer
        got = await server.receive_some(1 << 20)
        assert got == b"".join(b"request %d;" % i for i in range(10))
        page = bytes(range(256)) * 32 * 8  # 64 KiB: several records the other way
        await server.send_all(page)
        received = b""
        while len(received) < len(page):
            received += await client.receive_some(1 << 20)
        assert received == page
        await client.aclose()
        assert await server.receive_some(100) == b""  # close_notify, then EOF
        await server.aclose()


async def test_handshake_with_unknown_ca_fails(tls: TlsKit, tmp_path: Path) -> None:
    other = TlsKit.create(tmp_path)
    with trio.fail_after(10):
        server, client = await _pair(tls, other.ca_cert)
        server_errors: list[BaseException] = []

        async def serve() -> None:
            try:
                await server.do_handshake()
            except trio.BrokenResourceError as exc:
                server_errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with pytest.raises(trio.BrokenResourceError, match="certificate verify failed"):
                await client.do_handshake()
        assert server_errors and "unknown ca" in str(server_errors[0])
        await client.aclose()
        await server.aclose()


async def test_nowait_paths_keep_the_bytes_in_order(tls: TlsKit) -> None:
    """``receive_nowait`` / ``send_nowait`` / ``flush`` (the page service's fast paths): None
    when nothing is there, every buffered record when something is; a send larger than the
    socket takes is finished by ``flush``, in order with an ordinary ``send_all`` after it."""
    with trio.fail_after(20):
        server, client = await _pair(tls, tls.ca_cert)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.do_handshake)
            await client.do_handshake()
        assert server.receive_nowait(1 << 20) is None
        for i in range(5):
            await client.send_all(b"req %d;" % i)
        await trio.sleep(0.2)
        assert server.receive_nowait(1 << 20) == b"".join(b"req %d;" % i for i in range(5))
        big = bytes(range(256)) * 4096 * 8  # 8 MiB: more than the socket buffers hold
        received = bytearray()

        async def drain() -> None:
            while len(received) < len(big) + 4:
                received.extend(await client.receive_some(1 << 20))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            if not server.send_nowait(big):
                assert server.unsent
                await server.flush()
            await server.send_all(b"tail")
        assert bytes(received) == big + b"tail"
        await client.aclose()
        got = server.receive_nowait(100)
        while got is None:
            await server.wait_readable()
            got = server.receive_nowait(100)
        assert got == b""  # close_notify, then EOF
        await server.aclose()
