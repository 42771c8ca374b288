"""A pagestream client (v2 and v3): what a compute's smgr does, for tests, benchmarks and users.

    async with await PageClient.connect("127.0.0.1", 64000, tenant_id, timeline_id) as client:
        page = await client.get_page(RelTag(1663, 5, 16384, 0), blkno=0)
        responses = await client.pipelined(requests, queue_depth=32)

Built on ``common.pgclient`` (startup, Query, CopyBoth). ``send`` and ``receive`` are the
primitives: requests may be sent ahead of their responses (the compute's prefetch), responses
come back in request order and are matched to the oldest unanswered request; in v3 every
response must echo its request, and a mismatch is the server's protocol violation.
``pipelined`` keeps up to ``queue_depth`` requests in flight with one sender and one receiver
task (the CopyBoth rule: one task sends, one task receives).

``BlockingPageClient`` is the same stream over a blocking socket without trio, for load
drivers (``pagestore bench getpage`` runs one per client process): an event loop round per
response costs more CPU than the pageserver spends serving the page, and a benchmark whose
client is the bottleneck measures the client.

Auth and TLS: ``password=`` a tenant token, ``ssl_context=`` a verifying client context
(``common.tls.client_context``), on both clients (docs/auth.md).

A stream-ending ErrorResponse from the server raises ``PgError``; a per-request failure is an
``ErrorResponse`` value among the responses (``get_page`` raises it as ``PageRequestFailed``).
"""

from __future__ import annotations

import itertools
import socket
import ssl
import struct
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType

import trio

from common.pgclient import PgClientConnection, connect
from common.pgcopy import CopyBothStream
from common.tls_socket import BlockingTlsSocket, start_tls
from protocol.buffer import Reader
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.pagestream import (
    MAX_LSN,
    MAX_RESPONSE_MESSAGE_LEN,
    DbSizeRequest,
    DbSizeResponse,
    ErrorResponse,
    ExistsRequest,
    ExistsResponse,
    GetPageRequest,
    GetPageResponse,
    GetSlruSegmentRequest,
    GetSlruSegmentResponse,
    NblocksRequest,
    NblocksResponse,
    PagestreamVersion,
    RelTag,
    Request,
    Response,
    SlruKind,
    decode_response,
    encode_request_into,
)
from protocol.pgwire import CLOSED, BackendDecoder
from protocol.pgwire import NEED_DATA as PG_NEED_DATA
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError

RECEIVE_SIZE = 256 * 1024
_MSG_HDR = struct.Struct(">BI")
_COPY_DATA = ord("d")
_ERROR_RESPONSE = ord("E")
_COMPACT_AT = 1 << 20


class PageRequestFailed(Exception):
    """The server answered one request with a pagestream Error response."""

    def __init__(self, response: ErrorResponse) -> None:
        super().__init__(response.message)
        self.response = response


class PageClient:
    """One pagestream over one libpq connection."""

    def __init__(
        self, conn: PgClientConnection, copy: CopyBothStream, version: PagestreamVersion
    ) -> None:
        self.conn = conn
        self.copy = copy
        self.version = version
        self._in_flight: deque[Request] = deque()
        self._reqids = itertools.count(1)
        self._sent = trio.lowlevel.ParkingLot()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        *,
        version: PagestreamVersion = 3,
        user: str = "pagestore",
        params: Mapping[str, str] | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> PageClient:
        """``password``: a tenant token for a pageserver with auth on (docs/auth.md);
        ``ssl_context``: TLS, verified with it (``common.tls.client_context``)."""
        conn = await connect(host, port, user=user, params=params, password=password,
                             ssl_context=ssl_context)
        try:
            return await cls.start(conn, tenant_id, timeline_id, version=version)
        except BaseException:
            await conn.aclose()
            raise

    @classmethod
    async def start(
        cls,
        conn: PgClientConnection,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        *,
        version: PagestreamVersion = 3,
    ) -> PageClient:
        """Open the pagestream on an already started connection."""
        copy = await conn.copy_both(f"pagestream_v{version} {tenant_id.hex} {timeline_id.hex}")
        return cls(conn, copy, version)

    # -- primitives -------------------------------------------------------------------------

    def next_reqid(self) -> int:
        return next(self._reqids) if self.version == 3 else 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def send(self, *requests: Request) -> None:
        """Send requests without waiting for their responses (one ``send_all``)."""
        out = bytearray()
        for request in requests:
            encode_request_into(out, request, self.version, framed=True)
        self._in_flight.extend(requests)
        self._sent.unpark_all()
        await self.conn.send_bytes(out)

    async def receive(self) -> Response:
        """The response to the oldest unanswered request."""
        if not self._in_flight:
            raise LocalProtocolError("receive() with no request in flight")
        payload = await self.copy.receive()
        if payload is None:
            raise trio.BrokenResourceError("server ended the pagestream")
        # Pages are views into ``payload`` (a bytes object of its own), not into a buffer that
        # is reused, so responses stay valid.
        return decode_response(payload, self.version, self._in_flight.popleft())

    async def request(self, request: Request) -> Response:
        await self.send(request)
        return await self.receive()

    async def pipelined(self, requests: Sequence[Request], queue_depth: int) -> list[Response]:
        """Answer ``requests`` with up to ``queue_depth`` of them in flight at a time."""
        if queue_depth < 1:
            raise ValueError("queue_depth must be at least 1")
        if self._in_flight:
            raise LocalProtocolError("pipelined() with requests already in flight")
        slots = trio.Semaphore(queue_depth)
        responses: list[Response] = []

        async def sender() -> None:
            i = 0
            while i < len(requests):
                await slots.acquire()
                # Send everything the window allows in one write.
                burst = [requests[i]]
                i += 1
                while i < len(requests) and slots.value > 0:
                    slots.acquire_nowait()
                    burst.append(requests[i])
                    i += 1
                await self.send(*burst)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender, name="page_client.send")
            for _ in range(len(requests)):
                while not self._in_flight:
                    await self._sent.park()
                responses.append(await self.receive())
                slots.release()
        return responses

    # -- conveniences ------------------------------------------------------------------------

    def _header(self, lsn: Lsn, not_modified_since: Lsn | None) -> tuple[int, Lsn, Lsn]:
        # Without a known last-written LSN: "latest" promises nothing (0); a fixed LSN is its
        # own not_modified_since (the server then waits for it if it is ahead).
        if not_modified_since is None:
            not_modified_since = Lsn(0) if lsn == MAX_LSN else lsn
        return self.next_reqid(), lsn, not_modified_since

    async def get_page(
        self, rel: RelTag, blkno: int, lsn: Lsn = MAX_LSN, not_modified_since: Lsn | None = None
    ) -> bytes:
        request = GetPageRequest(*self._header(lsn, not_modified_since), rel, blkno)
        response = await self.request(request)
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, GetPageResponse)
        return bytes(response.page)

    async def exists(
        self, rel: RelTag, lsn: Lsn = MAX_LSN, not_modified_since: Lsn | None = None
    ) -> bool:
        response = await self.request(ExistsRequest(*self._header(lsn, not_modified_since), rel))
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, ExistsResponse)
        return response.exists

    async def nblocks(
        self, rel: RelTag, lsn: Lsn = MAX_LSN, not_modified_since: Lsn | None = None
    ) -> int:
        response = await self.request(NblocksRequest(*self._header(lsn, not_modified_since), rel))
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, NblocksResponse)
        return response.n_blocks

    async def db_size(
        self, dbnode: int, lsn: Lsn = MAX_LSN, not_modified_since: Lsn | None = None
    ) -> int:
        response = await self.request(DbSizeRequest(*self._header(lsn, not_modified_since), dbnode))
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, DbSizeResponse)
        return response.db_size

    async def slru_segment(
        self, kind: SlruKind, segno: int, lsn: Lsn = MAX_LSN, not_modified_since: Lsn | None = None
    ) -> bytes:
        request = GetSlruSegmentRequest(*self._header(lsn, not_modified_since), kind, segno)
        response = await self.request(request)
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, GetSlruSegmentResponse)
        return bytes(response.segment)

    # -- lifetime ----------------------------------------------------------------------------

    async def finish(self) -> None:
        """End the stream with CopyDone and return the connection to the idle state."""
        await self.conn.finish_copy()

    async def aclose(self) -> None:
        await self.conn.aclose()

    async def __aenter__(self) -> PageClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class BlockingPageClient:
    """One pagestream over a blocking TCP socket (no event loop): ``send`` requests ahead,
    ``receive`` responses in order, as ``PageClient`` does. Trust authentication only."""

    def __init__(self, sock: socket.socket | BlockingTlsSocket, version: PagestreamVersion) -> None:
        self.sock = sock
        self.version = version
        # Received bytes and the read position in them: framing is parsed in place and each
        # payload copied out once (a load driver's CPU is the server's competition).
        self._rbuf = bytearray()
        self._rpos = 0
        # recv_into one buffer: recv(n) allocates n bytes per call (on a TLS socket per record).
        self._recv_buf = bytearray(RECEIVE_SIZE)
        self._recv_view = memoryview(self._recv_buf)
        self._in_flight: deque[Request] = deque()
        self._reqids = itertools.count(1)
        self._out = bytearray()

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        *,
        version: PagestreamVersion = 3,
        user: str = "pagestore",
        params: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> BlockingPageClient:
        tcp = socket.create_connection((host, port), timeout=timeout_s)
        sock: socket.socket | BlockingTlsSocket = tcp
        try:
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                # Over memory BIOs: a receive takes every record there is (common.tls_socket).
                sock = start_tls(tcp, ssl_context, host)
            startup = {"user": user, "database": user, **(params or {})}
            decoder = BackendDecoder()
            sock.sendall(m.encode(m.StartupMessage(startup)))
            _await_message(sock, decoder, m.ReadyForQuery, password)
            query = f"pagestream_v{version} {tenant_id.hex} {timeline_id.hex}"
            sock.sendall(m.encode(m.Query(query)))
            _await_message(sock, decoder, m.CopyBothResponse)
            if decoder.buffered:
                # The server speaks only when asked once the stream is open.
                raise RemoteProtocolError("unsolicited data after CopyBothResponse")
            sock.settimeout(None)
        except BaseException:
            tcp.close()
            raise
        return cls(sock, version)

    def next_reqid(self) -> int:
        return next(self._reqids) if self.version == 3 else 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def send(self, *requests: Request) -> None:
        out = self._out
        out.clear()
        for request in requests:
            encode_request_into(out, request, self.version, framed=True)
        self._in_flight.extend(requests)
        self.sock.sendall(out)

    def receive(self) -> Response:
        """The response to the oldest unanswered request (blocks)."""
        if not self._in_flight:
            raise LocalProtocolError("receive() with no request in flight")
        tag, payload = self._next_message()
        if tag != _COPY_DATA:
            if tag == _ERROR_RESPONSE:
                raise PgError.from_response(m.ErrorResponse.decode(Reader(payload, "ErrorResponse")))
            raise RemoteProtocolError(f"unexpected message {bytes([tag])!r} during the pagestream")
        return decode_response(payload, self.version, self._in_flight.popleft())

    def _next_message(self) -> tuple[int, bytes]:
        buf, pos = self._rbuf, self._rpos
        while True:
            have = len(buf) - pos
            if have >= 5:
                tag, length = _MSG_HDR.unpack_from(buf, pos)
                if length < 4 or length > MAX_RESPONSE_MESSAGE_LEN:
                    raise RemoteProtocolError(f"bad message length {length}", sqlstate="08P01")
                end = pos + 1 + length
                if len(buf) >= end:
                    with memoryview(buf) as view:
                        payload = bytes(view[pos + 5 : end])
                    if end == len(buf):
                        buf.clear()
                        end = 0
                    elif end >= _COMPACT_AT:
                        del buf[:end]
                        end = 0
                    self._rpos = end
                    return tag, payload
            n = self.sock.recv_into(self._recv_buf)
            if not n:
                raise trio.BrokenResourceError("server closed the connection")
            buf += self._recv_view[:n]

    def get_page(self, rel: RelTag, blkno: int, lsn: Lsn = MAX_LSN) -> bytes:
        nms = Lsn(0) if lsn == MAX_LSN else lsn
        self.send(GetPageRequest(self.next_reqid(), lsn, nms, rel, blkno))
        response = self.receive()
        if isinstance(response, ErrorResponse):
            raise PageRequestFailed(response)
        assert isinstance(response, GetPageResponse)
        return bytes(response.page)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BlockingPageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _await_message(
    sock: socket.socket | BlockingTlsSocket, decoder: BackendDecoder, want: type, password: str | None = None
) -> None:
    """Read backend messages until one of type ``want``; an ErrorResponse raises ``PgError``;
    a password request is answered with ``password`` (the token)."""
    while True:
        msg = decoder.next_event()
        if msg is PG_NEED_DATA:
            decoder.receive_data(sock.recv(RECEIVE_SIZE))
            continue
        if msg is CLOSED:
            raise trio.BrokenResourceError("server closed the connection during startup")
        if isinstance(msg, want):
            return
        if isinstance(msg, m.ErrorResponse):
            raise PgError.from_response(msg)
        if isinstance(msg, m.AuthenticationCleartextPassword):
            if password is None:
                raise PgError("server requested a password (a token) but none was given",
                              "28P01", severity="FATAL")
            sock.sendall(m.encode(m.PasswordMessage(password)))
            continue
        if isinstance(
            msg,
            m.AuthenticationOk
            | m.ParameterStatus
            | m.BackendKeyData
            | m.NoticeResponse
            | m.NegotiateProtocolVersion,
        ):
            continue
        raise RemoteProtocolError(f"unexpected {type(msg).__name__} before the pagestream")
