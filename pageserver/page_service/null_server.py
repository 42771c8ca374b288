"""The benchmark floor: pagestream v3 servers that do nothing but answer GetPage.

``pagestore bench getpage --floor`` runs these beside the real pageserver, with the same client
processes, to show how far the page service is from the ceiling of *any* Python server on this
machine. Neither touches storage, metrics or a pipeline; every GetPage is answered with one
fixed 8 KiB page:

- ``serve_trio``: one trio task per connection over a non-blocking socket, reading the kernel
  first and parking in trio only when it has nothing (as ``DirectStreamIO`` does): the ceiling
  of any trio page service here.
- ``serve_blocking``: one thread per connection, plain blocking sockets, no event loop: the
  ceiling of any (single-process) Python server here.

Both speak the same wire as the pageserver as far as ``BlockingPageClient`` uses it: libpq
startup (trust), ``pagestream_v3 <tenant> <timeline>`` answered with CopyBothResponse, then
CopyData requests. The sans-IO part, ``NullPagestream``, parses the CopyData framing, checks
every message is a well-formed v3 GetPage, and answers it with the request echoed (the v3
rule, so the client's echo check verifies the floor did the work). Anything else ends the
connection with a FATAL ErrorResponse: this is not a page service, only its floor.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from typing import Final

import trio

from protocol.pagestream import BLCKSZ, RequestTag, ResponseTag
from protocol.pgwire import messages as m
from protocol.pgwire import sqlstate

RECEIVE_SIZE: Final = 256 * 1024
# Yield to the other connections at least this often (the real server's rule too).
YIELD_EVERY: Final = 32

_HDR: Final = struct.Struct(">BI")
_STARTUP_LEN: Final = struct.Struct(">I")
_PROTOCOL_3: Final = 196608
_COPY_DATA: Final = ord("d")
_QUERY: Final = ord("Q")
_TERMINATE: Final = ord("X")
_COPY_DONE: Final = ord("c")
# A v3 GetPage request: tag, reqid, lsn, not_modified_since, spc, db, rel, fork, blkno.
_GETPAGE_V3_LEN: Final = struct.calcsize(">BQQQIIIBI")
_MAX_STARTUP: Final = 10_000
# The response header up to the echoed fields: CopyData tag, length, response tag.
_RESPONSE_PREFIX: Final = struct.pack(
    ">cIB", b"d", 4 + _GETPAGE_V3_LEN + BLCKSZ, ResponseTag.GET_PAGE
)
_RESPONSE_SIZE: Final = 1 + 4 + _GETPAGE_V3_LEN + BLCKSZ


def null_page() -> bytes:
    """The page every GetPage is answered with."""
    return bytes(range(256)) * (BLCKSZ // 256)


class NullStreamEnd(Exception):
    """The connection is over: the client ended it, or it sent what the floor refuses
    (``reply`` is then the FATAL ErrorResponse to send before closing)."""

    def __init__(self, reply: bytes = b"") -> None:
        super().__init__("null pagestream ended")
        self.reply = reply


def _fatal(message: str, code: str) -> NullStreamEnd:
    return NullStreamEnd(m.encode(m.ErrorResponse.build(message, code, severity="FATAL")))


class NullPagestream:
    """Sans-IO connection state: ``receive(data)`` returns the bytes to send back, or raises
    ``NullStreamEnd``. Startup and the query are parsed by hand (once per connection); the
    stream loop is the hot path: framing, one tag/length check, echo, page."""

    __slots__ = ("_buf", "_page", "_started", "_streaming")

    def __init__(self, page: bytes | None = None) -> None:
        self._buf = bytearray()
        self._page = null_page() if page is None else page
        if len(self._page) != BLCKSZ:
            raise ValueError("the null page must be 8 KiB")
        self._started = False
        self._streaming = False

    def receive(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        if self._streaming:
            return self._stream(buf)
        return self._handshake(buf)

    def _handshake(self, buf: bytearray) -> bytes:
        out = bytearray()
        if not self._started:
            if len(buf) < 8:
                return b""
            (length,) = _STARTUP_LEN.unpack_from(buf)
            if length < 8 or length > _MAX_STARTUP:
                raise _fatal("bad startup packet length", sqlstate.PROTOCOL_VIOLATION)
            if len(buf) < length:
                return b""
            if _STARTUP_LEN.unpack_from(buf, 4)[0] != _PROTOCOL_3:
                raise _fatal("only a v3 StartupMessage is served", sqlstate.PROTOCOL_VIOLATION)
            del buf[:length]
            self._started = True
            out += m.encode(m.AuthenticationOk(), m.ReadyForQuery("I"))
        if len(buf) < 5:
            return bytes(out)
        tag, length = _HDR.unpack_from(buf)
        if tag != _QUERY or length < 5 or length > _MAX_STARTUP:
            if tag == _TERMINATE:
                raise NullStreamEnd(bytes(out))
            raise _fatal("expected a pagestream_v3 query", sqlstate.PROTOCOL_VIOLATION)
        if len(buf) < 1 + length:
            return bytes(out)
        query = bytes(buf[5:length]).decode("utf-8", "replace").split()
        del buf[: 1 + length]
        if len(query) != 3 or query[0] != "pagestream_v3":
            raise NullStreamEnd(
                bytes(out)
                + m.encode(
                    m.ErrorResponse.build(
                        "the null server serves pagestream_v3 only", sqlstate.FEATURE_NOT_SUPPORTED
                    ),
                    m.ReadyForQuery("I"),
                )
            )
        self._streaming = True
        out += m.encode(m.CopyBothResponse())
        if buf:
            out += self._stream(buf)
        return bytes(out)

    def _stream(self, buf: bytearray) -> bytes:
        out = bytearray()
        try:
            return self._answer(buf, out)
        except NullStreamEnd as end:
            # What was answered before the end still goes out, in order.
            raise NullStreamEnd(bytes(out) + end.reply) from None

    def _answer(self, buf: bytearray, out: bytearray) -> bytes:
        page = self._page
        pos = 0
        have = len(buf)
        while have - pos >= 5:
            tag, length = _HDR.unpack_from(buf, pos)
            end = pos + 1 + length
            if tag != _COPY_DATA:
                if tag in (_COPY_DONE, _TERMINATE):
                    raise NullStreamEnd()
                raise _fatal(
                    f"unexpected message {tag} in the pagestream", sqlstate.PROTOCOL_VIOLATION
                )
            if length != 4 + _GETPAGE_V3_LEN:
                raise _fatal("the null server answers v3 GetPage only", sqlstate.INTERNAL_ERROR)
            if end > have:
                break
            if buf[pos + 5] != RequestTag.GET_PAGE:
                raise _fatal("the null server answers v3 GetPage only", sqlstate.INTERNAL_ERROR)
            out += _RESPONSE_PREFIX
            out += buf[pos + 6 : end]
            out += page
            pos = end
        if pos:
            del buf[:pos]
        return bytes(out)


def listen(port: int = 0) -> socket.socket:
    """A listening socket on 127.0.0.1 (``port`` 0: a free one)."""
    return socket.create_server(("127.0.0.1", port), backlog=128)


def _configure(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---------------------------------------------------------------------------------------------
# trio


async def serve_trio(
    sock: socket.socket, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept on ``sock`` (a listening stdlib socket) forever, one task per connection."""
    sock.setblocking(False)
    task_status.started(sock.getsockname()[1])
    async with trio.open_nursery() as nursery:
        while True:
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            conn.setblocking(False)
            _configure(conn)
            nursery.start_soon(_trio_connection, conn)


async def _trio_connection(conn: socket.socket) -> None:
    stream = NullPagestream()
    served = 0
    with conn:
        while True:
            try:
                data = conn.recv(RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(conn)
                served = 0
                continue
            except OSError:
                return
            if not data:
                return
            try:
                out = stream.receive(data)
            except NullStreamEnd as end:
                await _trio_send(conn, end.reply)
                return
            if out:
                await _trio_send(conn, out)
                served += len(out) // _RESPONSE_SIZE
                if served >= YIELD_EVERY:
                    served = 0
                    await trio.lowlevel.checkpoint()


async def _trio_send(conn: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = conn.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(conn)
            continue
        except OSError:
            return
        view = view[sent:]


# ---------------------------------------------------------------------------------------------
# Blocking sockets, one thread per connection


def serve_blocking(sock: socket.socket, *, stop: threading.Event | None = None) -> None:
    """Accept on ``sock`` until ``stop`` is set (checked every 0.2 s), one thread per
    connection (daemon threads: they end with their connection or the process)."""
    sock.settimeout(0.2)
    while stop is None or not stop.is_set():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            if stop is not None and stop.is_set():
                return
            raise
        conn.settimeout(None)
        _configure(conn)
        threading.Thread(target=_blocking_connection, args=(conn,), daemon=True).start()


def _blocking_connection(conn: socket.socket) -> None:
    stream = NullPagestream()
    recv: Callable[[int], bytes] = conn.recv
    with conn:
        try:
            while data := recv(RECEIVE_SIZE):
                try:
                    out = stream.receive(data)
                except NullStreamEnd as end:
                    conn.sendall(end.reply)
                    return
                if out:
                    conn.sendall(out)
        except OSError:
            return
