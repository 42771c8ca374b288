"""The libpq server loop shared by the pageserver's page service and the safekeeper.

It owns everything between ``accept()`` and a query handler: the startup handshake
(SSLRequest answered ``S`` and the stream wrapped in TLS when the server has a certificate,
``N`` otherwise; GSSENC requests ``N``; CancelRequest; StartupMessage with ``options`` parsed
into a dict; a pluggable authenticator, which handlers ask ``conn.authorize(tenant_id)``
before each tenant's command), ParameterStatus/BackendKeyData/ReadyForQuery, simple-query
dispatch, rejection of the extended protocol (error, then skip to Sync), COPY modes, an idle
timeout, and graceful shutdown (clients get FATAL 57P01, then a deadline is enforced).

Handler API
-----------
A handler is any object with ``async handle_query(conn, query) -> None``. It answers through
the ``PgConnection``:

- ``await conn.send_rows(columns, rows)``: RowDescription + DataRows + CommandComplete;
- ``await conn.send_command_complete(tag)`` for commands without rows;
- ``raise PgError(message, sqlstate)`` (preferred) or ``await conn.send_error(...)``;
  the loop sends ErrorResponse and ReadyForQuery. ``RemoteProtocolError`` raised by a payload
  decoder is answered the same way with its SQLSTATE;
- ``copy = await conn.enter_copy_both()`` (or ``enter_copy_out()``) switches to COPY; then
  ``await copy.receive()`` -> payload | None, ``await copy.send(payload)``,
  ``await copy.send_many(payloads)``, ``copy.receive_nowait()``, ``await copy.send_done()``.
  When the handler returns, the loop sends CopyDone (unless sent), CommandComplete
  (``copy.command_tag``) and ReadyForQuery, or simply closes if the client hung up.

The loop sends ReadyForQuery after every query; if the handler sent nothing at all it first
sends CommandComplete with the query's first word upper-cased (``SET`` for ``set x=1``).

Context: ``conn.startup_params`` (user, database, application_name, replication, ...),
``conn.options`` (``-c name=value`` pairs from ``options``), ``conn.bind_log(tenant_id=...)``
adds fields to every later log line of the connection (and of tasks it starts afterwards).

Concurrency rules: the handler runs in the connection's task; it may open its own nursery
(a reader task and a writer task). ONE task sends at a time and ONE task receives at a time.
An exception in a handler's nursery arrives as an ExceptionGroup; the loop unwraps groups
whose only non-Cancelled member is a single exception, so a pipeline whose stages fail one at
a time reports cleanly.

Example (a safekeeper-like START_WAL_PUSH handler)::

    class Handler:
        async def handle_query(self, conn: PgConnection, query: str) -> None:
            if query == "IDENTIFY_SYSTEM":
                await conn.send_rows(["systemid", "timeline", "xlogpos", "dbname"],
                                     [("1", "1", "0/16B3748", None)])
            elif query.startswith("START_WAL_PUSH"):
                copy = await conn.enter_copy_both()
                send, recv = trio.open_memory_channel[bytes](16)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer, copy, recv)     # the only sender
                    with send:  # not ``async with``: see safekeeper.receive_wal._write_stage
                        while (payload := await copy.receive()) is not None:
                            try:
                                await send.send(handle(payload))
                            except trio.BrokenResourceError:
                                break  # the writer failed: its error ends the query
            else:
                raise PgError(f"unsupported command {query!r}", sqlstate.SYNTAX_ERROR)

    server = PgServer(Handler(), PgServerConfig(port=0))
    port = await nursery.start(server.serve)
    ...
    server.shutdown()          # clients get 57P01; handlers are cancelled after the deadline

Tests can run one connection over a memory stream: ``await server.serve_connection(stream)``.
"""

from __future__ import annotations

import errno
import itertools
import math
import secrets
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, Protocol

import attrs
import structlog
import trio

from common.linger import LINGER_S, linger
from common.pgcopy import CopyBothStream
from common.tls_stream import Offload, TlsStream
from protocol.buffer import WriteBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId
from protocol.pgwire import CLOSED, NEED_DATA, FrontendDecoder, sqlstate
from protocol.pgwire import messages as m
from protocol.pgwire.decoder import DEFAULT_MAX_MESSAGE_LEN
from protocol.pgwire.errors import PgError

log = structlog.get_logger("pgserver")

RECEIVE_SIZE = 256 * 1024
# recv_into gets at least this much room (usually the rest of a 2 MiB receive array).
RECEIVE_MIN = 256 * 1024
# A connection whose next receive waits this long releases its receive buffer until bytes
# arrive (idle page service and libpq connections then hold no receive memory).
IDLE_RELEASE_S = 1.0


@attrs.frozen
class PgServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    server_version: str = "15.0 (pagestore)"
    # A connection that sends nothing for this long is closed (FATAL 57P05); None disables.
    idle_timeout_s: float | None = 600.0
    startup_timeout_s: float = 10.0
    # After shutdown() handlers get this long to finish before they are cancelled.
    shutdown_timeout_s: float = 5.0
    max_message_len: int = DEFAULT_MAX_MESSAGE_LEN
    # TLS: True hands a connection's large writes to a sender thread of its own to encrypt
    # (common.tls_stream), False never; "auto" only while the event loop's thread waits for a
    # CPU (other processes on the cores): with a core free the thread costs more CPU per page
    # than the cipher it moves and lost every idle round, on a loaded host it wins
    # (docs/benchmarks.md, "Auth and TLS").
    tls_sender_thread: Offload = "auto"


class QueryHandler(Protocol):
    async def handle_query(self, conn: PgConnection, query: str) -> None: ...


class Authenticator(Protocol):
    """``authenticate`` runs after the StartupMessage and raises ``PgError`` (severity FATAL)
    to refuse; ``authorize`` is asked by handlers before each command that touches a tenant
    (``None``: a node-wide command) and raises ``PgError`` (FATAL) to refuse it."""

    async def authenticate(self, conn: PgConnection) -> None: ...

    def authorize(self, conn: PgConnection, tenant_id: TenantId | None) -> None: ...


class TrustAuthenticator:
    async def authenticate(self, conn: PgConnection) -> None:
        return

    def authorize(self, conn: PgConnection, tenant_id: TenantId | None) -> None:
        return


class CleartextPasswordAuthenticator:
    """AuthenticationCleartextPassword; ``check(user, password)`` decides."""

    def __init__(self, check: Callable[[str, str], bool]) -> None:
        self._check = check

    async def authenticate(self, conn: PgConnection) -> None:
        await conn.send_message(m.AuthenticationCleartextPassword())
        msg = await conn.receive_message()
        if msg is None:
            raise trio.BrokenResourceError("client closed during authentication")
        if not isinstance(msg, m.PasswordMessage):
            raise RemoteProtocolError(f"expected a password response, got {type(msg).__name__}")
        if not self._check(conn.user, msg.password):
            raise PgError(
                f'password authentication failed for user "{conn.user}"',
                sqlstate.INVALID_PASSWORD,
                severity="FATAL",
            )

    def authorize(self, conn: PgConnection, tenant_id: TenantId | None) -> None:
        return


@attrs.frozen
class Column:
    name: str
    type_oid: int = m.OID_TEXT


class IdleTimeout(Exception):
    """The client sent nothing for ``idle_timeout_s``."""


class _ClientGone(Exception):
    """EOF or Terminate: end the connection quietly."""


_EXTENDED = (m.Parse, m.Bind, m.Describe, m.Execute, m.Close)


def _encode_value(v: object) -> bytes | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v
    if isinstance(v, bool):
        return b"t" if v else b"f"
    if isinstance(v, bytearray | memoryview):
        return bytes(v)
    return str(v).encode("utf-8")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def primary_exception(exc: BaseException) -> BaseException:
    """The single meaningful exception inside (nested) groups, ignoring Cancelled siblings;
    the group itself when there is more than one."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [e for e in _leaves(exc) if not isinstance(e, trio.Cancelled)]
    if len(leaves) == 1:
        return leaves[0]
    if not leaves:
        return _leaves(exc)[0]
    return exc


class PgConnection:
    """One client connection: handshake state, the decoder, and the handler-facing API."""

    def __init__(self, server: PgServer, stream: trio.abc.Stream, conn_id: int, peer: str) -> None:
        self.server = server
        self._stream = stream
        self.conn_id = conn_id
        self.peer = peer
        self._decoder = FrontendDecoder(max_message_len=server.config.max_message_len)
        self.startup_params: dict[str, str] = {}
        self.options: dict[str, str] = {}
        self.process_id = secrets.randbits(31)
        self.secret_key = secrets.randbits(31)
        self._copy: CopyBothStream | None = None
        self._answered = False
        # True while a send_all is in flight; if it was interrupted the framing towards the
        # client is unknown and nothing more may be written.
        self._send_broken = False
        # A FATAL ErrorResponse was sent: the close lingers (serve_connection).
        self._sent_error = False
        self._query_scope: trio.CancelScope | None = None
        self.shutdown_requested = False
        # Set by the authenticator (common.pgauth: the token's claims); None under trust.
        self.claims: object | None = None
        self.tls = False

    # -- identity -----------------------------------------------------------------------------

    @property
    def user(self) -> str:
        return self.startup_params.get("user", "")

    @property
    def database(self) -> str:
        return self.startup_params.get("database", self.user)

    @property
    def transport(self) -> trio.abc.Stream:
        return self._stream

    def authorize(self, tenant_id: TenantId | None) -> None:
        """Refuse (``PgError``, FATAL) a command on ``tenant_id`` (``None``: node-wide) that
        this connection's credentials do not cover; a no-op under trust."""
        self.server.authenticator.authorize(self, tenant_id)

    def bind_log(self, **fields: Any) -> None:
        """Add fields (tenant_id, timeline_id, ...) to this connection's log context."""
        structlog.contextvars.bind_contextvars(**fields)

    # -- raw IO ----------------------------------------------------------------------------

    async def send_bytes(self, data: bytes | bytearray) -> None:
        if self._send_broken:
            raise trio.ClosedResourceError("an earlier send to this client was interrupted")
        self._answered = True
        self._send_broken = True
        await self._stream.send_all(data)
        self._send_broken = False

    async def send_message(self, *msgs: m.BackendMessage) -> None:
        await self.send_bytes(m.encode(*msgs))

    async def _receive_some(self) -> bytes:
        timeout = self.server.config.idle_timeout_s
        if timeout is None:
            return bytes(await self._stream.receive_some(RECEIVE_SIZE))
        with trio.move_on_after(timeout):
            return bytes(await self._stream.receive_some(RECEIVE_SIZE))
        raise IdleTimeout(f"no message from the client for {timeout} s")

    async def _receive_more(self, on_idle: Callable[[], object] | None = None) -> None:
        """Feed the decoder what the client sends next (EOF included). ``on_idle`` is called
        where the receive buffer's memory is released for an idle wait (see below), so that
        a consumer can release its own buffers too.

        On a socket the kernel copies straight into the decoder's buffer (``recv_into``):
        no ``bytes`` object per receive and no copy into the buffer afterwards. Other
        streams (memory streams in tests) go through ``receive_some``."""
        stream = self._stream
        if type(stream) is not trio.SocketStream:
            self._decoder.receive_data(await self._receive_some())
            return
        timeout = self.server.config.idle_timeout_s
        now = trio.current_time()
        deadline = now + (math.inf if timeout is None else timeout)
        while True:
            window = self._decoder.receive_window(RECEIVE_MIN)
            n = -1
            try:
                # A receive that waits longer than IDLE_RELEASE_S gives up its window (below).
                with trio.move_on_at(min(deadline, now + IDLE_RELEASE_S)):
                    try:
                        n = await stream.socket.recv_into(window)
                    except OSError as exc:
                        # What trio.SocketStream.receive_some raises for the same failures.
                        if exc.errno in (errno.EBADF, errno.ENOTSOCK):
                            raise trio.ClosedResourceError(
                                "this socket was already closed"
                            ) from None
                        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            finally:
                del window
                self._decoder.receive_commit(max(n, 0))
            if n >= 0:
                break
            if trio.current_time() >= deadline:
                raise IdleTimeout(f"no message from the client for {timeout} s")
            # Idle: hold no receive memory (~RECEIVE_MIN, or the 2 MiB arrays of a zero-copy
            # stream) while waiting; it is allocated again when bytes arrive.
            self._decoder.release_idle_memory()
            if on_idle is not None:
                on_idle()
            with trio.move_on_at(deadline) as idle:
                await trio.lowlevel.wait_readable(stream.socket)
            if idle.cancelled_caught:
                raise IdleTimeout(f"no message from the client for {timeout} s")
            now = trio.current_time()
        if n == 0:
            self._decoder.receive_data(b"")

    def take_receive_buffer(self) -> bytes:
        """Remove and return the bytes received but not yet decoded.

        For a handler that reads the transport itself during COPY (the page service decodes
        pagestream requests straight from the bytes); it gives back whatever follows the end
        of its stream with ``restore_receive_buffer``.
        """
        # The pgwire decoder (protocol/, not ours) has no public drain.
        buf = self._decoder._buf
        data = buf.take(len(buf))
        # The handler reads the transport itself from now on: keep no receive memory.
        self._decoder.release_idle_memory()
        return data

    def restore_receive_buffer(self, data: bytes) -> None:
        """Put back bytes a handler read past the end of its COPY stream (see above)."""
        if self._decoder.buffered:
            raise LocalProtocolError("restore_receive_buffer with bytes still buffered")
        if data:
            self._decoder.receive_data(data)

    def receive_message_nowait(self) -> m.FrontendMessage | None:
        """A message already buffered; ``None`` at EOF; ``trio.WouldBlock`` otherwise."""
        ev = self._decoder.next_event()
        if ev is NEED_DATA:
            raise trio.WouldBlock
        if ev is CLOSED:
            return None
        return ev

    async def receive_message(self) -> m.FrontendMessage | None:
        """The next client message, ``None`` at EOF."""
        while True:
            ev = self._decoder.next_event()
            if ev is CLOSED:
                return None
            if ev is not NEED_DATA:
                await trio.lowlevel.checkpoint()
                return ev
            await self._receive_more()

    # -- handler API -------------------------------------------------------------------------

    async def send_rows(
        self,
        columns: Sequence[str | Column],
        rows: Iterable[Sequence[object]],
        *,
        command_tag: str | None = None,
    ) -> None:
        """RowDescription, one DataRow per row, CommandComplete, all in one send.

        Values: None is NULL, bytes go as-is, bool is t/f, anything else ``str()`` (UTF-8).
        """
        cols = [c if isinstance(c, Column) else Column(c) for c in columns]
        buf = WriteBuffer()
        m.RowDescription(tuple(m.FieldDescription(c.name, c.type_oid) for c in cols)).encode(buf)
        n = 0
        for row in rows:
            if len(row) != len(cols):
                raise LocalProtocolError(f"row has {len(row)} values for {len(cols)} columns")
            m.DataRow(tuple(_encode_value(v) for v in row)).encode(buf)
            n += 1
        m.CommandComplete(command_tag or f"SELECT {n}").encode(buf)
        await self.send_bytes(buf.take())

    async def send_command_complete(self, tag: str) -> None:
        await self.send_message(m.CommandComplete(tag))

    async def send_error(
        self,
        message: str,
        code: str = sqlstate.INTERNAL_ERROR,
        *,
        severity: str = "ERROR",
        detail: str | None = None,
    ) -> None:
        await self.send_message(m.ErrorResponse.build(message, code, severity=severity, detail=detail))

    async def send_notice(self, message: str) -> None:
        await self.send_message(m.NoticeResponse.build(message))

    async def enter_copy_both(self, command_tag: str | None = None) -> CopyBothStream:
        """Send CopyBothResponse and return the stream for CopyData in both directions."""
        return await self._enter_copy(m.CopyBothResponse(), True, command_tag)

    async def enter_copy_out(self, command_tag: str | None = None) -> CopyBothStream:
        """Send CopyOutResponse; the returned stream can only send."""
        return await self._enter_copy(m.CopyOutResponse(), False, command_tag)

    async def _enter_copy(
        self, response: m.CopyBothResponse | m.CopyOutResponse, can_receive: bool, tag: str | None
    ) -> CopyBothStream:
        if self._copy is not None:
            raise LocalProtocolError("already in COPY mode")
        self._copy = CopyBothStream(self, can_receive=can_receive, command_tag=tag or "COPY")
        await self.send_message(response)
        return self._copy

    def _copy_message(self, stream: CopyBothStream, msg: m.FrontendMessage | None) -> bytes | None:
        if isinstance(msg, m.CopyData):
            return msg.data
        if msg is None or isinstance(msg, m.Terminate):
            stream.peer_closed = True
            return None
        if isinstance(msg, m.CopyDone):
            stream.peer_done = True
            return None
        if isinstance(msg, m.CopyFail):
            stream.peer_done = True
            raise PgError(f"COPY failed: {msg.message}", sqlstate.QUERY_CANCELED)
        raise RemoteProtocolError(f"unexpected {type(msg).__name__} message during COPY")

    async def copy_receive(self, stream: CopyBothStream) -> bytes | None:
        while True:
            msg = await self.receive_message()
            if not isinstance(msg, m.Sync | m.Flush):  # PostgreSQL ignores these during COPY
                return self._copy_message(stream, msg)

    async def copy_receive_views(self, stream: CopyBothStream) -> list[memoryview] | None:
        """The zero-copy batch form of ``copy_receive``: every complete CopyData payload
        already received (waiting for at least one), as ``memoryview`` s of the receive
        buffer, or ``None`` once the client ended the COPY (CopyDone, Terminate, EOF).

        A view stays valid and unchanged for as long as it is held: the buffer never reuses
        memory under a live view, so views may be queued (e.g. for a ``pwritev``) while
        receiving goes on. Holding views pins receive memory (``ReceiveBuffer.ARENA_SIZE``
        arrays), so queue them only as far as the consumer's bound allows."""
        return await self._copy_receive(stream, None)

    async def copy_receive_scan(
        self, stream: CopyBothStream, scan: Callable[[bytearray, int, int, int], int]
    ) -> list[memoryview] | None:
        """The kernel form of ``copy_receive_views``: first ``scan`` runs over the receive
        buffer itself (``FrontendDecoder.copy_data_scan``: it consumes complete CopyData
        messages it understands and keeps their result); if it took something, ``[]``.
        Otherwise the next CopyData payload as a one-view list, as ``copy_receive_views``
        (waiting for bytes when nothing complete is buffered), or ``None`` once the client
        ended the COPY. If ``scan`` has a ``release_idle_memory()`` method, it is called
        whenever the connection releases its receive memory for an idle wait."""
        return await self._copy_receive(stream, scan)

    async def _copy_receive(
        self, stream: CopyBothStream, scan: Callable[[bytearray, int, int, int], int] | None
    ) -> list[memoryview] | None:
        if not stream.can_receive:
            raise LocalProtocolError("this copy stream is send-only")
        received = False
        decoder = self._decoder
        # a scanner that keeps buffers of its own gives them back while the client is idle
        on_idle = getattr(scan, "release_idle_memory", None)
        while not stream.finished_receiving:
            if scan is not None and decoder.copy_data_scan(scan):
                if not received:
                    await trio.lowlevel.checkpoint()
                return []
            views = decoder.copy_data_views() if scan is None else decoder.copy_data_views(1)
            if views:
                if not received:
                    # A checkpoint per batch, as receive_message has per message.
                    await trio.lowlevel.checkpoint()
                return views
            ev = decoder.next_event()
            if ev is NEED_DATA:
                await self._receive_more(on_idle)
                received = True
                continue
            if isinstance(ev, m.Sync | m.Flush):  # PostgreSQL ignores these during COPY
                continue
            payload = self._copy_message(stream, None if ev is CLOSED else ev)
            if payload is None:
                return None
            return [memoryview(payload)]
        return None

    def copy_receive_nowait(self, stream: CopyBothStream) -> bytes | None:
        while True:
            msg = self.receive_message_nowait()
            if not isinstance(msg, m.Sync | m.Flush):
                return self._copy_message(stream, msg)

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            with trio.fail_after(self.server.config.startup_timeout_s):
                if not await self._startup():
                    return
            await self._query_loop()
        except BaseException as raw:
            exc = primary_exception(raw)
            if isinstance(exc, trio.Cancelled) or not isinstance(exc, Exception):
                raise
            await self._end_with(exc, raw)

    async def _end_with(self, exc: Exception, raw: BaseException) -> None:
        """Connection-level failure: tell the client if we still can, then close."""
        if isinstance(exc, _ClientGone):
            log.debug("client disconnected")
            return
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
            log.info("client went away", error=str(exc))
            return
        if isinstance(exc, trio.TooSlowError):
            log.info("startup timed out")
            return
        if isinstance(exc, IdleTimeout):
            log.info("closing idle connection", error=str(exc))
            await self._try_fatal(str(exc), sqlstate.IDLE_SESSION_TIMEOUT)
            return
        if isinstance(exc, RemoteProtocolError):
            log.info("protocol violation by client", error=exc.msg, sqlstate=exc.sqlstate)
            await self._try_fatal(exc.msg, exc.sqlstate)
            return
        if isinstance(exc, PgError):
            log.info("closing connection", error=exc.message, sqlstate=exc.sqlstate)
            await self._try_fatal(exc.message, exc.sqlstate)
            return
        log.error("connection failed", exc_info=raw)
        await self._try_fatal(f"internal error: {exc}", sqlstate.INTERNAL_ERROR)

    async def _try_fatal(self, message: str, code: str, *, linger: bool = True) -> None:
        """Send a FATAL ErrorResponse if the framing towards the client is intact. ``linger``:
        the connection's close then lingers (``serve_connection``), as for any error; not for
        a server shutdown, which must not wait for clients."""
        if self._send_broken:
            return
        with trio.move_on_after(1.0):
            try:
                await self.send_message(m.ErrorResponse.build(message, code, severity="FATAL"))
                self._sent_error = linger
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _startup(self) -> bool:
        while True:
            msg = await self.receive_message()
            if msg is None:
                return False
            if isinstance(msg, m.SSLRequest):
                await self._answer_ssl_request()
                continue
            if isinstance(msg, m.GSSENCRequest):
                await self.send_bytes(b"N")
                continue
            if isinstance(msg, m.CancelRequest):
                self.server._cancel(msg.process_id, msg.secret_key)
                return False
            if isinstance(msg, m.StartupMessage):
                break
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} during startup")
        self.startup_params = dict(msg.parameters)
        if self.server.ssl_context is not None and not self.tls:
            raise PgError(
                "this server accepts TLS connections only (use sslmode=require or stronger)",
                sqlstate.INVALID_AUTHORIZATION_SPECIFICATION,
                severity="FATAL",
            )
        if not self.user:
            raise PgError(
                "no PostgreSQL user name specified in startup packet",
                sqlstate.INVALID_AUTHORIZATION_SPECIFICATION,
                severity="FATAL",
            )
        self.options = msg.options
        self.bind_log(user=self.user)
        await self.server.authenticator.authenticate(self)
        await self.send_message(
            m.AuthenticationOk(),
            m.ParameterStatus("server_version", self.server.config.server_version),
            m.ParameterStatus("integer_datetimes", "on"),
            m.ParameterStatus("client_encoding", "UTF8"),
            m.ParameterStatus("server_encoding", "UTF8"),
            m.ParameterStatus("DateStyle", "ISO, MDY"),
            m.BackendKeyData(self.process_id, self.secret_key),
            m.ReadyForQuery("I"),
        )
        self.server._register(self)
        log.debug("connection ready", params=self.startup_params)
        return True

    async def _answer_ssl_request(self) -> None:
        """``N`` without a certificate; otherwise ``S`` and the TLS handshake, after which
        everything (the StartupMessage first) arrives through the TLS stream."""
        ctx = self.server.ssl_context
        if ctx is None or self.tls:
            await self.send_bytes(b"N")
            return
        if self._decoder.buffered:
            # Sent before our answer, so not protected by TLS (CVE-2021-23214's injection).
            raise RemoteProtocolError("unencrypted bytes after the SSLRequest")
        await self.send_bytes(b"S")
        tls: TlsStream | trio.SSLStream[trio.abc.Stream]
        if isinstance(self._stream, trio.SocketStream):
            # Hands the handlers every record already received (pagestream batching).
            tls = TlsStream(self._stream, ctx, server_side=True,
                            offload=self.server.config.tls_sender_thread)
        else:
            tls = trio.SSLStream(self._stream, ctx, server_side=True)
        await tls.do_handshake()
        self._stream = tls
        self.tls = True

    async def _query_loop(self) -> None:
        while True:
            msg = await self.receive_message()
            if msg is None or isinstance(msg, m.Terminate):
                return
            if isinstance(msg, m.Query):
                await self._run_query(msg.query)
                if self._copy is not None and self._copy.peer_closed:
                    return
                self._copy = None
            elif isinstance(msg, m.Sync):
                await self.send_message(m.ReadyForQuery("I"))
            elif isinstance(msg, m.Flush):
                continue  # everything we write is already flushed
            elif isinstance(msg, _EXTENDED):
                await self._reject_extended()
            elif isinstance(msg, m.CopyData | m.CopyDone | m.CopyFail):
                # Left over from a COPY that ended with an error; PostgreSQL ignores them too.
                continue
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} message")

    async def _reject_extended(self) -> None:
        await self.send_message(
            m.ErrorResponse.build(
                "extended query protocol is not supported; use simple queries",
                sqlstate.FEATURE_NOT_SUPPORTED,
            )
        )
        while True:
            msg = await self.receive_message()
            if msg is None or isinstance(msg, m.Terminate):
                raise _ClientGone
            if isinstance(msg, m.Sync):
                await self.send_message(m.ReadyForQuery("I"))
                return

    async def _run_query(self, query: str) -> None:
        self._answered = False
        log.debug("query", query=query[:200])
        try:
            with trio.CancelScope() as scope:
                self._query_scope = scope
                await self.server.handler.handle_query(self, query)
        except BaseException as raw:
            exc = primary_exception(raw)
            if isinstance(exc, trio.Cancelled) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, PgError):
                if exc.severity in ("FATAL", "PANIC"):
                    raise exc from None
                await self._answer_error(exc.to_response())
            elif isinstance(exc, RemoteProtocolError) and not self._decoder.failed:
                # A payload decoder refused a CopyData; the framing itself is intact.
                log.info("bad request payload", error=exc.msg, sqlstate=exc.sqlstate)
                await self._answer_error(m.ErrorResponse.build(exc.msg, exc.sqlstate))
            elif isinstance(
                exc,
                RemoteProtocolError | IdleTimeout | _ClientGone | trio.BrokenResourceError | trio.ClosedResourceError,
            ):
                raise exc from None
            else:
                log.error("query handler failed", query=query[:200], exc_info=raw)
                await self._answer_error(
                    m.ErrorResponse.build(f"internal error: {exc!r}", sqlstate.INTERNAL_ERROR)
                )
            return
        finally:
            self._query_scope = None
        if scope.cancelled_caught:
            await self._answer_error(
                m.ErrorResponse.build("canceling statement due to user request", sqlstate.QUERY_CANCELED)
            )
            return
        copy = self._copy
        if copy is not None:
            if copy.peer_closed:
                return
            out = WriteBuffer()
            if not copy.sent_done:
                m.CopyDone().encode(out)
            m.CommandComplete(copy.command_tag).encode(out)
            m.ReadyForQuery("I").encode(out)
            await self.send_bytes(out.take())
            return
        if not self._answered:
            tag = query.strip().split(maxsplit=1)[0].upper() if query.strip() else ""
            first: m.BackendMessage = m.CommandComplete(tag) if tag else m.EmptyQueryResponse()
            await self.send_message(first, m.ReadyForQuery("I"))
            return
        await self.send_message(m.ReadyForQuery("I"))

    async def _answer_error(self, err: m.ErrorResponse) -> None:
        if self._send_broken:
            raise trio.ClosedResourceError("cannot report the error: an earlier send was interrupted")
        await self.send_message(err, m.ReadyForQuery("I"))


class PgServer:
    """Listens, runs one ``PgConnection`` per client, shuts down gracefully."""

    def __init__(
        self,
        handler: QueryHandler,
        config: PgServerConfig | None = None,
        *,
        authenticator: Authenticator | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.handler = handler
        self.config = config or PgServerConfig()
        self.authenticator: Authenticator = authenticator or TrustAuthenticator()
        # With a context, SSLRequest is answered ``S`` and plaintext startups are refused.
        self.ssl_context = ssl_context
        self.port: int | None = None
        self._ids = itertools.count(1)
        self._shutting_down = trio.Event()
        self._by_key: dict[tuple[int, int], PgConnection] = {}
        self._open = 0

    @property
    def connection_count(self) -> int:
        return self._open

    def shutdown(self) -> None:
        """Stop accepting, tell every client 57P01, cancel handlers after the deadline."""
        self._shutting_down.set()

    @property
    def shutting_down(self) -> trio.Event:
        return self._shutting_down

    def _register(self, conn: PgConnection) -> None:
        self._by_key[(conn.process_id, conn.secret_key)] = conn

    def _cancel(self, process_id: int, secret_key: int) -> None:
        conn = self._by_key.get((process_id, secret_key))
        if conn is not None and conn._query_scope is not None:
            log.info("cancel request", target_conn_id=conn.conn_id)
            conn._query_scope.cancel()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``config.host:config.port``; reports the bound port via ``task_status``.

        Returns after ``shutdown()`` once every connection has ended (at most
        ``shutdown_timeout_s`` later). Cancelling it instead drops clients without 57P01.
        """
        listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = int(listeners[0].socket.getsockname()[1])
        log.info("pg server listening", host=self.config.host, port=self.port)
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptor:
                acceptor.start_soon(
                    partial(
                        trio.serve_listeners,
                        self._handle_socket,
                        listeners,
                        handler_nursery=connections,
                    )
                )
                task_status.started(self.port)
                await self._shutting_down.wait()
                acceptor.cancel_scope.cancel()
            connections.cancel_scope.deadline = trio.current_time() + self.config.shutdown_timeout_s
        log.info("pg server stopped", port=self.port)

    async def _handle_socket(self, stream: trio.SocketStream) -> None:
        try:
            stream.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "unknown"
        await self.serve_connection(stream, peer)

    async def serve_connection(self, stream: trio.abc.Stream, peer: str = "memory") -> None:
        """Run one connection to completion and close the stream (memory streams welcome)."""
        conn_id = next(self._ids)
        conn = PgConnection(self, stream, conn_id, peer)
        self._open += 1
        # bind_log() adds keys to the calling task's context; restore it afterwards in case
        # the caller runs several connections in one task (tests do).
        saved_log_context = structlog.contextvars.get_contextvars()
        try:
            with structlog.contextvars.bound_contextvars(conn_id=conn_id, peer=peer):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_shutdown, conn, nursery.cancel_scope)
                    await conn._run()
                    nursery.cancel_scope.cancel()
                if conn.shutdown_requested:
                    log.info("terminating connection: server shutdown")
                    await conn._try_fatal(
                        "terminating connection due to administrator command",
                        sqlstate.ADMIN_SHUTDOWN,
                        linger=False,
                    )
        finally:
            self._open -= 1
            self._by_key.pop((conn.process_id, conn.secret_key), None)
            structlog.contextvars.clear_contextvars()
            structlog.contextvars.bind_contextvars(**saved_log_context)
            try:
                # Ended with an error the client was told of: a lingering close, so that a
                # client still sending reads the error instead of a reset (common.linger).
                lingering = (conn._sent_error and not conn._send_broken
                             and not self._shutting_down.is_set())
                if conn.tls and not conn._send_broken:
                    # close_notify, so the client sees an orderly end rather than a TLS EOF
                    # error.
                    transport = conn.transport
                    if lingering and isinstance(transport, TlsStream):
                        transport.linger_on_close = True
                        await self._unless_shutdown(transport.aclose, 0.5 + LINGER_S)
                    else:
                        with trio.move_on_after(0.5):
                            try:
                                await transport.aclose()
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                pass
                elif lingering and isinstance(stream, trio.SocketStream):
                    await self._unless_shutdown(partial(linger, stream), LINGER_S)
            finally:
                await trio.aclose_forcefully(stream)

    async def _unless_shutdown(self, close: Callable[[], Awaitable[object]], seconds: float) -> None:
        """``close()``, given up after ``seconds`` or when the server shuts down (a lingering
        connection must not hold the server's shutdown)."""
        async with trio.open_nursery() as nursery:
            async def on_shutdown() -> None:
                await self._shutting_down.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_shutdown)
            with trio.move_on_after(seconds):
                try:
                    await close()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            nursery.cancel_scope.cancel()

    async def _watch_shutdown(self, conn: PgConnection, scope: trio.CancelScope) -> None:
        await self._shutting_down.wait()
        conn.shutdown_requested = True
        scope.cancel()
