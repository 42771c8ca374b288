"""Buffer-based decoders for the PostgreSQL v3 wire protocol (h11 style).

``FrontendDecoder`` runs on the server: it decodes what a client sends, starting with the
untagged startup packets (SSLRequest, GSSENCRequest, CancelRequest, StartupMessage) and then
tagged messages. ``BackendDecoder`` runs on the client: it decodes what a server sends. Both:

    decoder.receive_data(data)     # bytes from the network; b"" means EOF
    event = decoder.next_event()   # a message, NEED_DATA, or CLOSED after a clean EOF

Limits (checked on the length word, before anything is buffered for the body):
- startup packets: 8..10000 bytes (PostgreSQL's and Neon's bound);
- "small" frontend messages (Sync, Flush, Terminate, CopyDone, Describe, Close, Execute):
  10000 bytes, and PasswordMessage 65536, as PostgreSQL 15 does;
- everything else: ``max_message_len``, default 16 MiB. PostgreSQL allows 1 GiB, but nothing
  pagestore exchanges comes close (WAL is streamed in <= 128 KiB chunks, pages are 8 KiB),
  and a smaller bound keeps one hostile client from pinning a gigabyte.

Any violation raises ``RemoteProtocolError`` (08P01 unless more specific); the decoder is
then broken and keeps raising, because framing is lost.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final

from protocol.buffer import TAG_LEN, U32, Buffer, Reader, ReceiveBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.pgwire import messages as m
from protocol.pgwire import sqlstate


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"


NEED_DATA: Final = Sentinel.NEED_DATA
CLOSED: Final = Sentinel.CLOSED

DEFAULT_MAX_MESSAGE_LEN: Final = 16 * 1024 * 1024
SMALL_MESSAGE_LIMIT: Final = 10_000
MAX_STARTUP_PACKET_LEN: Final = 10_000
MAX_AUTH_TOKEN_LEN: Final = 65_536

_STARTUP_HEADER: Final = U32  # length word; the request code follows
_BodyDecoder = Callable[[Reader], object]

FRONTEND_DECODERS: Final[dict[bytes, Callable[[Reader], m.FrontendMessage]]] = {
    b"p": m.PasswordMessage.decode,
    b"Q": m.Query.decode,
    b"X": m.Terminate.decode,
    b"d": m.CopyData.decode,
    b"c": m.CopyDone.decode,
    b"f": m.CopyFail.decode,
    b"S": m.Sync.decode,
    b"H": m.Flush.decode,
    b"P": m.Parse.decode,
    b"B": m.Bind.decode,
    b"D": m.Describe.decode,
    b"E": m.Execute.decode,
    b"C": m.Close.decode,
}
FRONTEND_NAMES: Final = {
    b"p": "PasswordMessage",
    b"Q": "Query",
    b"X": "Terminate",
    b"d": "CopyData",
    b"c": "CopyDone",
    b"f": "CopyFail",
    b"S": "Sync",
    b"H": "Flush",
    b"P": "Parse",
    b"B": "Bind",
    b"D": "Describe",
    b"E": "Execute",
    b"C": "Close",
}
_FRONTEND_SMALL: Final = frozenset(b"SHXcDCE")
_COPY_DATA_TAG: Final = ord("d")

BACKEND_DECODERS: Final[dict[bytes, Callable[[Reader], m.BackendMessage]]] = {
    b"R": m._decode_authentication,
    b"S": m.ParameterStatus.decode,
    b"K": m.BackendKeyData.decode,
    b"Z": m.ReadyForQuery.decode,
    b"T": m.RowDescription.decode,
    b"D": m.DataRow.decode,
    b"C": m.CommandComplete.decode,
    b"I": m.EmptyQueryResponse.decode,
    b"E": m.ErrorResponse.decode,
    b"N": m.NoticeResponse.decode,
    b"G": m.CopyInResponse.decode,
    b"H": m.CopyOutResponse.decode,
    b"W": m.CopyBothResponse.decode,
    b"d": m.CopyData.decode,
    b"c": m.CopyDone.decode,
    b"1": m.ParseComplete.decode,
    b"2": m.BindComplete.decode,
    b"3": m.CloseComplete.decode,
    b"n": m.NoData.decode,
    b"s": m.PortalSuspended.decode,
    b"t": m.ParameterDescription.decode,
    b"A": m.NotificationResponse.decode,
    b"v": m.NegotiateProtocolVersion.decode,
}
BACKEND_NAMES: Final = {
    b"R": "Authentication",
    b"S": "ParameterStatus",
    b"K": "BackendKeyData",
    b"Z": "ReadyForQuery",
    b"T": "RowDescription",
    b"D": "DataRow",
    b"C": "CommandComplete",
    b"I": "EmptyQueryResponse",
    b"E": "ErrorResponse",
    b"N": "NoticeResponse",
    b"G": "CopyInResponse",
    b"H": "CopyOutResponse",
    b"W": "CopyBothResponse",
    b"d": "CopyData",
    b"c": "CopyDone",
    b"1": "ParseComplete",
    b"2": "BindComplete",
    b"3": "CloseComplete",
    b"n": "NoData",
    b"s": "PortalSuspended",
    b"t": "ParameterDescription",
    b"A": "NotificationResponse",
    b"v": "NegotiateProtocolVersion",
}


class _Decoder:
    """Shared framing: buffer, EOF, the sticky error."""

    __slots__ = ("_buf", "_eof", "_error", "max_message_len")

    side: str = "peer"

    def __init__(self, *, max_message_len: int = DEFAULT_MAX_MESSAGE_LEN) -> None:
        if max_message_len < 5:
            raise LocalProtocolError("max_message_len must be at least 5")
        self._buf = ReceiveBuffer()
        self._eof = False
        self._error: RemoteProtocolError | None = None
        self.max_message_len = max_message_len

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return len(self._buf)

    @property
    def eof(self) -> bool:
        return self._eof

    @property
    def failed(self) -> bool:
        """True once a framing error was raised: the byte stream can no longer be trusted."""
        return self._error is not None

    def receive_data(self, data: Buffer) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its sending side."""
        if self._eof:
            if data:
                raise LocalProtocolError("receive_data() after EOF")
            return
        if data:
            self._buf.append(data)
        else:
            self._eof = True

    def receive_window(self, min_size: int) -> memoryview:
        """Room for at least ``min_size`` bytes to receive into (``socket.recv_into``) without
        an intermediate copy; ``receive_commit(n)`` then adds the first ``n`` of them. EOF is
        still reported with ``receive_data(b"")``."""
        if self._eof:
            raise LocalProtocolError("receive_window() after EOF")
        return self._buf.writable(min_size)

    def receive_commit(self, n: int) -> None:
        """The first ``n`` bytes of the last ``receive_window`` arrived (0: none)."""
        self._buf.commit(n)

    def release_idle_memory(self) -> bool:
        """Give back the receive memory when nothing is buffered (an idle connection);
        False if bytes are buffered. See ``ReceiveBuffer.release_memory``."""
        return self._buf.release_memory()

    @property
    def receive_capacity(self) -> int:
        """Bytes of receive memory held now."""
        return self._buf.capacity

    def copy_data_views(self, limit: int = 1 << 30) -> list[memoryview]:
        """The fast path for COPY streams: the payloads of the complete CopyData messages at
        the front of the buffer (at most ``limit``), as zero-copy views that stay valid and
        unchanged for as long as they are held. Returns ``[]`` when the next message is
        anything else, incomplete or malformed; ``next_event`` then decodes (or rejects) it
        exactly as before."""
        if self._error is not None:
            return []
        return self._buf.take_frames(_COPY_DATA_TAG, self.max_message_len, limit)

    def copy_data_scan(self, fn: Callable[[bytearray, int, int, int], int]) -> int:
        """The kernel form of ``copy_data_views``: ``fn(array, start, end, max_message_len)``
        consumes complete messages straight from the receive buffer and returns where it
        stopped (see ``ReceiveBuffer.scan``); it must leave anything it does not understand
        (another tag, a bad length, an incomplete message) for ``next_event``. Returns the
        bytes consumed (0 when the decoder is unusable)."""
        if self._error is not None:
            return 0
        return self._buf.scan(fn, self.max_message_len)

    def _fail(self, msg: str, code: str = sqlstate.PROTOCOL_VIOLATION) -> RemoteProtocolError:
        self._error = RemoteProtocolError(msg, sqlstate=code)
        return self._error

    def _check_usable(self) -> None:
        if self._error is not None:
            raise RemoteProtocolError(
                f"decoder unusable after earlier error: {self._error.msg}",
                sqlstate=self._error.sqlstate,
            )

    def _at_eof(self) -> Sentinel:
        if not self._buf:
            return CLOSED if self._eof else NEED_DATA
        if self._eof:
            raise self._fail(
                f"connection closed by {self.side} in the middle of a message "
                f"({len(self._buf)} bytes buffered)"
            )
        return NEED_DATA

    def _next_tagged(
        self,
        decoders: dict[bytes, Callable[[Reader], m.Message]],
        names: dict[bytes, str],
        small: frozenset[int],
    ) -> m.Message | Sentinel:
        buf = self._buf
        if len(buf) < 5:
            return self._at_eof()
        tag, length = buf.unpack_from(TAG_LEN)
        assert isinstance(tag, bytes) and isinstance(length, int)
        decode = decoders.get(tag)
        if decode is None:
            raise self._fail(f"unknown {self.side} message tag {tag!r}")
        if tag[0] in small:
            limit = SMALL_MESSAGE_LIMIT
        elif tag == b"p":
            limit = MAX_AUTH_TOKEN_LEN
        else:
            limit = self.max_message_len
        if length < 4 or length > limit:
            raise self._fail(f"invalid {names[tag]} message length {length} (limit {limit})")
        if len(buf) < 1 + length:
            return self._at_eof()
        buf.consume(5)
        body = buf.take(length - 4)
        if tag == b"d":  # hot path: CopyData carries every sub-protocol message
            return m.CopyData(body)
        reader = Reader(body, names[tag])
        try:
            msg = decode(reader)
            reader.expect_end()
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        except (ValueError, OverflowError) as exc:  # e.g. an attrs validator on hostile data
            raise self._fail(f"malformed {names[tag]}: {exc}") from None
        return msg


class FrontendDecoder(_Decoder):
    """Server side: decodes client messages, startup packets first."""

    __slots__ = ("_in_startup",)
    side = "client"

    def __init__(self, *, max_message_len: int = DEFAULT_MAX_MESSAGE_LEN) -> None:
        super().__init__(max_message_len=max_message_len)
        self._in_startup = True

    @property
    def in_startup(self) -> bool:
        """True until a StartupMessage has been decoded (startup packets are untagged)."""
        return self._in_startup

    def next_event(self) -> m.FrontendMessage | Sentinel:
        self._check_usable()
        if self._in_startup:
            return self._next_startup()
        msg = self._next_tagged(FRONTEND_DECODERS, FRONTEND_NAMES, _FRONTEND_SMALL)  # type: ignore[arg-type]
        return msg  # type: ignore[return-value]

    def copy_data_views(self, limit: int = 1 << 30) -> list[memoryview]:
        if self._in_startup:
            return []
        return super().copy_data_views(limit)

    def copy_data_scan(self, fn: Callable[[bytearray, int, int, int], int]) -> int:
        if self._in_startup:
            return 0
        return super().copy_data_scan(fn)

    def _next_startup(self) -> m.StartupPacket | Sentinel:
        buf = self._buf
        if len(buf) < 4:
            return self._at_eof()
        (length,) = buf.unpack_from(_STARTUP_HEADER)
        assert isinstance(length, int)
        if length < 8 or length > MAX_STARTUP_PACKET_LEN:
            raise self._fail(f"invalid startup packet length {length}")
        if len(buf) < length:
            return self._at_eof()
        buf.consume(4)
        reader = Reader(buf.take(length - 4), "startup packet")
        code = reader.u32()
        try:
            if code == m.SSL_REQUEST_CODE:
                reader.expect_end()
                return m.SSLRequest()
            if code == m.GSSENC_REQUEST_CODE:
                reader.expect_end()
                return m.GSSENCRequest()
            if code == m.CANCEL_REQUEST_CODE:
                reader.what = "CancelRequest"
                msg: m.StartupPacket = m.CancelRequest(reader.i32(), reader.i32())
                reader.expect_end()
                return msg
            if code >> 16 != 3 or code & 0xFFFF != 0:
                raise self._fail(
                    f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: "
                    "server supports 3.0",
                    sqlstate.FEATURE_NOT_SUPPORTED,
                )
            reader.what = "StartupMessage"
            msg = m.StartupMessage.decode_parameters(reader, code)
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        self._in_startup = False
        return msg


class BackendDecoder(_Decoder):
    """Client side: decodes server messages (all tagged)."""

    __slots__ = ()
    side = "server"

    def next_event(self) -> m.BackendMessage | Sentinel:
        self._check_usable()
        msg = self._next_tagged(BACKEND_DECODERS, BACKEND_NAMES, frozenset())  # type: ignore[arg-type]
        return msg  # type: ignore[return-value]
