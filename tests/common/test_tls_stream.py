"""common.tls_stream: a receive returns every TLS record already received; handshake, EOF;
large inline writes leaving in pieces; the sender thread that encrypts large writes (order, a
read meanwhile, backlog, a broken connection, the thread's end)."""

from __future__ import annotations

import fcntl
import random
import socket
import struct
import termios
import threading
from pathlib import Path
from typing import Literal

import pytest
import trio
import trio.testing

from common.tls import client_context, server_context
from common.tls_stream import (
    OFFLOAD_BACKLOG,
    OFFLOAD_MIN_BYTES,
    SENDER_SAMPLE_S,
    STREAM_PIECE,
    CpuContention,
    TlsStream,
)
from tests.auth_helpers import TlsKit


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


async def _pair(
    tls: TlsKit, ca: Path, *, offload: bool | Literal["auto"] = True
) -> tuple[TlsStream, TlsStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    client_sock = await trio.testing.open_stream_to_socket_listener(listeners[0])
    server_sock = await listeners[0].accept()
    await listeners[0].aclose()
    assert isinstance(client_sock, trio.SocketStream) and isinstance(server_sock, trio.SocketStream)
    server = TlsStream(server_sock, server_context(tls.cert, tls.key), server_side=True,
                       offload=offload)
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


@pytest.mark.parametrize("offload", [True, False], ids=["thread", "inline"])
async def test_nowait_paths_keep_the_bytes_in_order(tls: TlsKit, offload: bool) -> None:
    """``receive_nowait`` / ``send_nowait`` / ``flush`` (the page service's fast paths): None
    when nothing is there, every buffered record when something is; a send larger than the
    socket takes (inline: the socket fills between two pieces) is finished by ``flush``, in
    order with an ordinary ``send_all`` after it."""
    with trio.fail_after(20):
        server, client = await _pair(tls, tls.ca_cert, offload=offload)
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


def _readable_bytes(sock: trio.socket.SocketType) -> int:
    got = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    return int(struct.unpack("i", got)[0])


async def test_a_large_inline_write_leaves_in_pieces(tls: TlsKit, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the sender thread, a write larger than ``STREAM_PIECE`` (a batch's responses) is
    encrypted and written piece by piece: the first piece's records are on the client's socket
    before the second piece is encrypted (the client decrypts while the server encrypts), and
    the client gets every byte in order; a small write is encrypted whole."""
    payload = random.Random(7).randbytes(4 * STREAM_PIECE + 1234)
    with trio.fail_after(20):
        server, client = await _pair(tls, tls.ca_cert, offload=False)
        await _handshake(server, client)
        await server.send_all(b"hello")  # the client also takes the session tickets here
        assert await client.receive_some(100) == b"hello"
        assert _readable_bytes(client.transport_stream.socket) == 0
        pieces: list[int] = []
        on_the_wire: list[int] = []  # ciphertext bytes the client could read, per encryption
        encrypt = server._write_inline

        def spy(data: bytes | bytearray | memoryview) -> None:
            on_the_wire.append(_readable_bytes(client.transport_stream.socket))
            pieces.append(len(data))
            encrypt(data)

        monkeypatch.setattr(server, "_write_inline", spy)
        assert server.send_nowait(b"small")
        assert pieces == [5]
        received = bytearray()
        while len(received) < 5:
            received.extend(await client.receive_some(1 << 20))
        pieces.clear()
        on_the_wire.clear()
        if not server.send_nowait(payload):  # the socket filled: flush writes the rest
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, client, 5 + len(payload), received)
                await server.flush()
        else:
            await _drain(client, 5 + len(payload), received)
        assert bytes(received) == b"small" + payload
        assert pieces[0] == STREAM_PIECE and len(pieces) >= 2, pieces
        assert on_the_wire[0] == 0 and on_the_wire[1] > STREAM_PIECE, on_the_wire
        await client.aclose()
        await server.aclose()


# -- the sender thread (large writes encrypted off the event loop's thread) -----------------


def _senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tls-sender"]


async def _no_sender_left() -> None:
    with trio.fail_after(5):
        while _senders():
            await trio.sleep(0.02)


async def _handshake(server: TlsStream, client: TlsStream) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        await client.do_handshake()


async def test_sender_thread_keeps_every_byte_in_order(tls: TlsKit) -> None:
    """Large writes go to the sender thread, small ones stay inline unless the thread still has
    work (then they queue behind it): the client receives exactly what was sent, in order,
    while requests keep arriving and being read the other way; after close_notify and
    ``aclose`` no thread is left."""
    rng = random.Random(19)
    sends = [rng.randbytes(rng.choice([100, 9000, OFFLOAD_MIN_BYTES, 300_000])) for _ in range(60)]
    sent = b"".join(sends)
    with trio.fail_after(30):
        server, client = await _pair(tls, tls.ca_cert)
        await _handshake(server, client)
        received = bytearray()
        requests = [b"request %d;" % i for i in range(200)]
        got_requests = bytearray()

        async def client_side() -> None:
            for r in requests:
                await client.send_all(r)
            while len(received) < len(sent):
                received.extend(await client.receive_some(1 << 20))

        async def server_reads() -> None:
            while len(got_requests) < sum(map(len, requests)):
                got = server.receive_nowait(1 << 20)
                if got is None:
                    await server.wait_readable()
                    continue
                got_requests.extend(got)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_side)
            nursery.start_soon(server_reads)
            for data in sends:
                if not server.send_nowait(data):
                    await server.flush()
                await trio.lowlevel.checkpoint()
            await server.send_all(b"")  # everything written before it returns
            assert not server.unsent
        assert server.offloaded >= sum(len(d) >= OFFLOAD_MIN_BYTES for d in sends)
        assert bytes(received) == sent
        assert bytes(got_requests) == b"".join(requests)
        await client.aclose()
        got = server.receive_nowait(100)
        while got is None:
            await server.wait_readable()
            got = server.receive_nowait(100)
        assert got == b""  # close_notify after the data, then EOF
        await server.aclose()
        await _no_sender_left()


async def test_a_read_waits_for_the_sender_and_loses_nothing(tls: TlsKit) -> None:
    """While the thread holds the SSL object, ``receive_nowait`` neither blocks nor drops what
    the socket gave it: None, then ``wait_readable`` returns once the thread lets go, and the
    bytes are there."""
    with trio.fail_after(10):
        server, client = await _pair(tls, tls.ca_cert)
        await _handshake(server, client)
        assert server.send_nowait(bytes(OFFLOAD_MIN_BYTES))  # the thread exists from now on
        received = bytearray()
        while len(received) < OFFLOAD_MIN_BYTES:
            received.extend(await client.receive_some(1 << 20))
        await client.send_all(b"first;")
        await trio.sleep(0.1)
        held, release = threading.Event(), threading.Event()

        def hold_the_lock() -> None:  # what the thread does while it encrypts
            with server._ssl_lock:
                held.set()
                release.wait(5)
            with server._state:
                server._notify_locked()

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        held.wait(5)
        assert server.receive_nowait(1 << 20) is None  # did not block, did not lose
        await client.send_all(b"second;")
        await trio.sleep(0.1)
        assert server.receive_nowait(1 << 20) is None
        release.set()
        await server.wait_readable()
        holder.join()
        got = b""
        while got != b"first;second;":
            more = server.receive_nowait(1 << 20)
            if more is None:
                await server.wait_readable()
                continue
            got += more
        # A receive parked on the socket when the thread takes the lock: what arrives then is
        # kept for after the thread's piece.
        result: list[bytes] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _receive_into(server, result))
            await trio.sleep(0.1)  # parked in the socket read
            held.clear()
            release.clear()
            holder = threading.Thread(target=hold_the_lock)
            holder.start()
            held.wait(5)
            await client.send_all(b"third;")
            await trio.sleep(0.1)
            assert not result
            release.set()
        holder.join()
        assert result == [b"third;"]
        await client.aclose()
        await server.aclose()
        await _no_sender_left()


async def _receive_into(stream: TlsStream, result: list[bytes]) -> None:
    result.append(await stream.receive_some(1 << 20))


async def test_sender_backlog_holds_the_writer_back(tls: TlsKit) -> None:
    """A client that does not read: ``send_nowait`` answers False once the thread holds more
    than ``OFFLOAD_BACKLOG``, and ``flush`` waits until the client reads."""
    with trio.fail_after(30):
        server, client = await _pair(tls, tls.ca_cert)
        await _handshake(server, client)
        chunk = bytes(range(256)) * 1024  # 256 KiB
        sent = 0
        while server.send_nowait(chunk):
            sent += len(chunk)
            assert sent < 64 * OFFLOAD_BACKLOG
        sent += len(chunk)
        assert server.unsent
        with trio.move_on_after(0.3) as waited:
            await server.flush()
        assert waited.cancelled_caught  # nobody reads: the backlog stays
        received = bytearray()

        async def drain() -> None:
            while len(received) < sent:
                received.extend(await client.receive_some(1 << 20))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await server.flush()
        assert bytes(received) == chunk * (sent // len(chunk))
        await client.aclose()
        await server.aclose()
        await _no_sender_left()


@pytest.mark.parametrize("offload", [True, False], ids=["thread", "inline"])
async def test_sender_thread_reports_a_broken_connection(tls: TlsKit, offload: bool) -> None:
    """The client vanishes (RST) while the thread (or the inline pieces) write: the next send
    or flush raises BrokenResourceError, ``aclose`` returns, and no thread is left."""
    with trio.fail_after(30):
        server, client = await _pair(tls, tls.ca_cert, offload=offload)
        await _handshake(server, client)
        sock = client.transport_stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # unread data and linger 0: the server's writes fail with ECONNRESET
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(1000):
                if not server.send_nowait(bytes(256 * 1024)):
                    await server.flush()
                await trio.sleep(0.001)
        await server.aclose()
        await _no_sender_left()


async def _fill_backlog(server: TlsStream) -> int:
    """Send to a client that does not read until the sender thread holds its backlog."""
    chunk = bytes(range(256)) * 1024  # 256 KiB: offloaded
    sent = 0
    while server.send_nowait(chunk):
        sent += len(chunk)
    return sent + len(chunk)


async def _drain(client: TlsStream, count: int, received: bytearray) -> None:
    while len(received) < count:
        received.extend(await client.receive_some(1 << 20))


async def test_two_tasks_waiting_for_the_backlog_both_wake(tls: TlsKit) -> None:
    """The pipeline's Reading (``if tls.unsent: await tls.flush()``) and Execution (``flush``
    after a send) can wait for the sender thread at once: both must be woken."""
    server, client = await _pair(tls, tls.ca_cert)
    await _handshake(server, client)
    sent = await _fill_backlog(server)
    done: list[str] = []

    async def waiter(name: str) -> None:
        await server.flush()
        done.append(name)

    received = bytearray()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "execution")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(waiter, "reading")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(_drain, client, sent, received)
    assert sorted(done) == ["execution", "reading"]
    assert len(received) == sent
    await client.aclose()
    await server.aclose()
    await _no_sender_left()


async def test_a_flush_and_a_read_waiting_together_both_wake(tls: TlsKit) -> None:
    """Execution waits in ``flush`` for the backlog while Reading waits in ``wait_readable``
    for the SSL lock (held here as the thread holds it for one piece): when the lock goes and
    the client reads, both go on."""
    server, client = await _pair(tls, tls.ca_cert)
    await _handshake(server, client)
    sent = await _fill_backlog(server)
    flushed = trio.Event()
    read_ready = trio.Event()

    async def execution() -> None:
        await server.flush()
        flushed.set()

    async def reading() -> None:
        await server.wait_readable()
        read_ready.set()

    held, release = threading.Event(), threading.Event()

    def one_piece_of_encryption() -> None:  # the sender thread's order: release, then wake
        with server._ssl_lock:
            held.set()
            release.wait(5)
        with server._state:
            server._notify_locked()

    received = bytearray()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(execution)
            await trio.testing.wait_all_tasks_blocked()
            holder = threading.Thread(target=one_piece_of_encryption)
            holder.start()
            assert held.wait(5)
            assert server.receive_nowait(1 << 20) is None  # the lock is taken
            nursery.start_soon(reading)
            await trio.testing.wait_all_tasks_blocked()
            await client.send_all(b"request;")
            release.set()
            await trio.to_thread.run_sync(holder.join)
            await read_ready.wait()
            nursery.start_soon(_drain, client, sent, received)
            await flushed.wait()
    assert len(received) == sent
    assert await server.receive_some(1 << 20) == b"request;"
    await client.aclose()
    await server.aclose()
    await _no_sender_left()


# -- "auto": the sender thread only while the event loop's thread waits for a CPU -----------


def test_cpu_contention_reads_the_run_queue_delay(tmp_path: Path) -> None:
    """Contended when the thread waited for a CPU more than 10 % of a window (the second field
    of schedstat, ns); sampled at most once per window; a sample after a long gap starts a
    window; no file: never contended."""
    stat = tmp_path / "schedstat"
    now = [100.0]
    seen = CpuContention(str(stat), clock=lambda: now[0])

    def sample(delay_ns: int, after_s: float) -> bool:
        now[0] += after_s
        stat.write_text(f"123456 {delay_ns} 7\n")
        return seen()

    assert not sample(1_000_000, 0)  # the first sample has nothing to compare with
    assert sample(1_000_000 + 50_000_000, 0.2)  # 50 ms of 200 waiting: 25 %
    assert sample(1_000_000 + 50_000_000, SENDER_SAMPLE_S / 2)  # within the window: kept
    assert not sample(1_000_000 + 55_000_000, 0.2)  # 5 ms of 200: 2.5 %
    assert sample(1_000_000 + 105_000_000, 0.2)  # 50 ms of 200 again
    # after an idle gap: 60 ms of waiting over 5 s is no verdict on the last window (it would
    # read 1.2 %); the sample starts a window, the next one judges it
    assert sample(1_000_000 + 165_000_000, 5.0)
    assert sample(1_000_000 + 190_000_000, 0.2)  # 25 ms of 200: 12.5 %
    assert not sample(1_000_000 + 191_000_000, 0.2)
    assert CpuContention(str(tmp_path / "absent"))() is False
    assert isinstance(CpuContention()(), bool)  # this machine's own file reads


@pytest.mark.parametrize("contended", [False, True])
async def test_auto_hands_off_only_while_contended(tls: TlsKit, contended: bool) -> None:
    """offload="auto": a large write goes to the sender thread while the event loop's thread is
    starved of CPU, else inline in pieces; the client gets every byte in order either way."""
    payload = random.Random(3).randbytes(3 * STREAM_PIECE)
    with trio.fail_after(20):
        server, client = await _pair(tls, tls.ca_cert, offload="auto")
        server._contended = lambda: contended
        await _handshake(server, client)
        received = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, client, 2 * len(payload), received)
            for _ in range(2):
                if not server.send_nowait(payload):
                    await server.flush()
            offloaded = server.offloaded
            await server.send_all(b"")
        assert bytes(received) == payload * 2
        assert offloaded == (2 if contended else 0)
        await client.aclose()
        await server.aclose()
        await _no_sender_left()


class _WriteSpy:
    """An SSL object whose writes are recorded: (plaintext bytes, ciphertext bytes the client
    could read at that moment)."""

    def __init__(self, obj: object, client: TlsStream) -> None:
        self._obj = obj
        self._client = client
        self.writes: list[tuple[int, int]] = []

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.writes.append((len(data), _readable_bytes(self._client.transport_stream.socket)))
        return int(self._obj.write(data))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._obj, name)


async def test_sender_thread_in_pieces_keeps_the_order_under_a_full_socket(tls: TlsKit) -> None:
    """The sender thread writing in ``STREAM_PIECE`` pieces (``bench getpage --security
    auth+tls-thread64``): a batch-sized job leaves piece by piece, the first on the client's
    socket before the second is encrypted; with a client that does not read, the socket fills
    and the thread's backlog holds the writer back, small writes queue behind the thread's;
    once the client reads, every byte arrives in order."""
    rng = random.Random(64)
    batch = 32 * (8192 + 22)  # a pipelined batch's responses
    with trio.fail_after(30):
        server, client = await _pair(tls, tls.ca_cert)
        await _handshake(server, client)
        await server.send_all(b"hello")  # the client also takes the session tickets here
        assert await client.receive_some(100) == b"hello"
        server._offload_piece = STREAM_PIECE
        spy = _WriteSpy(server._obj, client)
        server._obj = spy  # type: ignore[assignment]
        sends = [rng.randbytes(batch)]
        assert server.send_nowait(sends[0])
        while not spy.writes:
            await trio.sleep(0.01)
        assert server.offloaded == 1
        assert spy.writes[0] == (STREAM_PIECE, 0), spy.writes
        while len(spy.writes) < 2:  # the thread is at its second piece
            await trio.sleep(0.01)
        assert spy.writes[1][1] > 0, spy.writes  # the first piece is on the wire
        while True:  # nobody reads: the socket fills, then the backlog
            data = rng.randbytes(rng.choice([batch, 100, 9000, batch]))
            sends.append(data)
            if not server.send_nowait(data):
                break
            assert len(sends) < 2000
            await trio.lowlevel.checkpoint()
        assert server.unsent
        received = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, client, sum(map(len, sends)) + 4, received)
            await server.flush()
            await server.send_all(b"tail")
        assert bytes(received) == b"".join(sends) + b"tail"
        pieces = [n for n, _ in spy.writes]
        assert pieces[: batch // STREAM_PIECE + 1] == [STREAM_PIECE] * (batch // STREAM_PIECE) + [
            batch % STREAM_PIECE
        ], pieces
        assert max(pieces) <= STREAM_PIECE
        await client.aclose()
        await server.aclose()
        await _no_sender_left()
