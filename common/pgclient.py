"""An async libpq client on trio, built on our own protocol code (no libpq, no psycopg).

Users: the walproposer bridge (a replication connection to a vanilla PostgreSQL 15, and
START_WAL_PUSH to safekeepers), the pageserver's WAL receiver (START_REPLICATION to a
safekeeper), the pagestream client and tests.

    conn = await connect("127.0.0.1", port, user="postgres", dbname="postgres",
                         params={"replication": "true"},
                         options={"tenant_id": t, "timeline_id": tl})   # -> "-c k=v ..."
    rows = await conn.query("IDENTIFY_SYSTEM")        # list of tuples of str | None
    copy = await conn.copy_both("START_REPLICATION PHYSICAL 0/1000000")
    while (payload := await copy.receive()) is not None:   # None: server sent CopyDone
        ...; await copy.send(status_update)
    await conn.finish_copy()    # CopyDone both ways, then CommandComplete/ReadyForQuery
    await conn.aclose()

An ErrorResponse raises ``PgError`` (``.sqlstate``, ``.message``, ``.severity``); after a FATAL
or PANIC one the session is over: the stream is closed before the error is raised (during COPY,
marked closed for ``aclose()``), and no Terminate is sent. A server that breaks the protocol
raises ``RemoteProtocolError``. Auth: trust, cleartext password, MD5.
One task sends and one task receives at a time (the CopyBoth rule of ``common.pgcopy``).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import attrs
import structlog
import trio

from common.pgcopy import CopyBothStream
from common.tls_stream import TlsStream
from protocol.buffer import WriteBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.pgwire import CLOSED, NEED_DATA, BackendDecoder, sqlstate
from protocol.pgwire import messages as m
from protocol.pgwire.decoder import DEFAULT_MAX_MESSAGE_LEN
from protocol.pgwire.errors import PgError

log = structlog.get_logger("pgclient")

RECEIVE_SIZE = 256 * 1024
Row = tuple[str | None, ...]

# What a refused, dropped, silent or misbehaving server raises from this client: callers that
# retry another server catch these and let everything else (bugs, cancellation) through.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
    RemoteProtocolError,
    PgError,
)


@attrs.frozen
class QueryResult:
    columns: tuple[str, ...]
    rows: list[Row]
    command_tag: str


# Error severities after which the server closes the connection.
_SESSION_ENDING = frozenset({"FATAL", "PANIC"})


def format_options(options: Mapping[str, str]) -> str:
    """``{"a": "x y"}`` -> ``-c a=x\\ y`` (the startup ``options`` syntax)."""

    def esc(s: str) -> str:
        return "".join("\\" + c if c.isspace() or c == "\\" else c for c in s)

    return " ".join(f"-c {esc(k)}={esc(v)}" for k, v in options.items())


def _md5_password(user: str, password: str, salt: bytes) -> str:
    inner = hashlib.md5((password + user).encode()).hexdigest()
    return "md5" + hashlib.md5(inner.encode() + salt).hexdigest()


def _text(v: bytes | None) -> str | None:
    if v is None:
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError(
            "server sent a non-UTF-8 value", sqlstate=sqlstate.CHARACTER_NOT_IN_REPERTOIRE
        ) from None


async def connect(
    host: str,
    port: int,
    *,
    user: str = "pagestore",
    dbname: str | None = None,
    password: str | None = None,
    params: Mapping[str, str] | None = None,
    options: Mapping[str, str] | str | None = None,
    connect_timeout_s: float = 10.0,
    max_message_len: int = DEFAULT_MAX_MESSAGE_LEN,
    ssl_context: ssl.SSLContext | None = None,
) -> PgClientConnection:
    """Open a TCP connection and run the startup handshake (``PgError`` on refusal).

    With ``ssl_context`` the connection is TLS or nothing (psql's ``sslmode=verify-full``
    when the context verifies, as ``common.tls.client_context`` does): SSLRequest first, and
    a server that answers ``N`` is refused."""
    with trio.fail_after(connect_timeout_s):
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        try:
            if ssl_context is not None:
                stream = await start_tls(stream, ssl_context, host)
            return await PgClientConnection.open(
                stream,
                user=user,
                dbname=dbname,
                password=password,
                params=params,
                options=options,
                max_message_len=max_message_len,
            )
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise


async def start_tls(stream: trio.abc.Stream, ctx: ssl.SSLContext, host: str) -> trio.abc.Stream:
    """SSLRequest, then the TLS handshake; ``PgError`` if the server does not do TLS."""
    await stream.send_all(m.encode(m.SSLRequest()))
    answer = await stream.receive_some(1)
    if answer == b"N":
        raise PgError(
            "server does not support SSL, but SSL was required",
            sqlstate.CONNECTION_FAILURE,
            severity="FATAL",
        )
    if answer != b"S":
        raise RemoteProtocolError(f"unexpected answer {answer[:1]!r} to the SSLRequest")
    tls: TlsStream | trio.SSLStream[trio.abc.Stream]
    if isinstance(stream, trio.SocketStream):
        # Every record already received per receive, no per-call buffer allocation.
        tls = TlsStream(stream, ctx, server_side=False, server_hostname=host)
    else:
        tls = trio.SSLStream(stream, ctx, server_hostname=host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__ or exc
        raise PgError(f"TLS handshake with {host} failed: {cause}", sqlstate.CONNECTION_FAILURE,
                      severity="FATAL") from None
    return tls


async def connect_with_params(host: str, port: int, params: dict[str, str]) -> PgClientConnection:
    """``connect`` with every startup parameter in one dict, as libpq's keyword list:
    ``user`` (default ``postgres``), ``dbname``, ``options``, ``password`` (a JWT for
    pagestore's nodes) and ``sslrootcert`` (a CA file: TLS, verified as ``verify-full``) are
    taken out, the rest (``replication``, ``application_name``...) are sent as they are."""
    rest = dict(params)
    user = rest.pop("user", "postgres")
    dbname = rest.pop("dbname", None)
    options = rest.pop("options", None)
    password = rest.pop("password", None)
    root = rest.pop("sslrootcert", None)
    ctx = None
    if root:
        from common.tls import client_context

        ctx = client_context(Path(root))
    return await connect(host, port, user=user, dbname=dbname, params=rest, options=options,
                         password=password, ssl_context=ctx)


class PgClientConnection:
    """A started libpq connection; see the module docstring."""

    def __init__(self, stream: trio.abc.Stream, max_message_len: int) -> None:
        self._stream = stream
        self._decoder = BackendDecoder(max_message_len=max_message_len)
        self.server_params: dict[str, str] = {}
        self.backend_key: m.BackendKeyData | None = None
        self.notices: list[m.NoticeResponse] = []
        self._copy: CopyBothStream | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        stream: trio.abc.Stream,
        *,
        user: str,
        dbname: str | None = None,
        password: str | None = None,
        params: Mapping[str, str] | None = None,
        options: Mapping[str, str] | str | None = None,
        max_message_len: int = DEFAULT_MAX_MESSAGE_LEN,
    ) -> PgClientConnection:
        """Run the startup handshake over an already-open byte stream."""
        conn = cls(stream, max_message_len)
        startup: dict[str, str] = {"user": user, "database": dbname or user}
        startup.update(params or {})
        if options:
            startup["options"] = options if isinstance(options, str) else format_options(options)
        await conn.send_bytes(m.encode(m.StartupMessage(startup)))
        while True:
            msg = await conn._receive()
            if isinstance(msg, m.AuthenticationOk):
                continue
            if isinstance(msg, m.AuthenticationCleartextPassword | m.AuthenticationMD5Password):
                if password is None:
                    raise PgError(
                        "server requested a password but none was given",
                        sqlstate.INVALID_PASSWORD,
                        severity="FATAL",
                    )
                secret = (
                    password
                    if isinstance(msg, m.AuthenticationCleartextPassword)
                    else _md5_password(user, password, msg.salt)
                )
                await conn.send_bytes(m.encode(m.PasswordMessage(secret)))
            elif isinstance(msg, m.AuthenticationSASL):
                raise PgError(
                    f"SASL authentication ({', '.join(msg.mechanisms)}) is not supported by "
                    "pagestore's client; use trust, password or md5",
                    sqlstate.FEATURE_NOT_SUPPORTED,
                    severity="FATAL",
                )
            elif isinstance(msg, m.BackendKeyData):
                conn.backend_key = msg
            elif isinstance(msg, m.ReadyForQuery):
                return conn
            elif isinstance(msg, m.ErrorResponse):
                raise PgError.from_response(msg)
            elif isinstance(msg, m.NegotiateProtocolVersion):
                continue
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} during startup")

    # -- IO ------------------------------------------------------------------------------------

    @property
    def transport(self) -> trio.abc.Stream:
        return self._stream

    async def send_bytes(self, data: bytes | bytearray) -> None:
        await self._stream.send_all(data)

    async def _receive_raw(self) -> m.BackendMessage | None:
        while True:
            ev = self._decoder.next_event()
            if ev is CLOSED:
                return None
            if ev is not NEED_DATA:
                return ev
            data = await self._stream.receive_some(RECEIVE_SIZE)
            self._decoder.receive_data(data)

    def _asynchronous(self, msg: m.BackendMessage) -> bool:
        """Messages a server may send at any time; True if handled here."""
        if isinstance(msg, m.ParameterStatus):
            self.server_params[msg.name] = msg.value
            return True
        if isinstance(msg, m.NoticeResponse):
            self.notices.append(msg)
            del self.notices[:-100]
            log.debug("server notice", message=msg.message, sqlstate=msg.sqlstate)
            return True
        return isinstance(msg, m.NotificationResponse)

    async def _receive(self) -> m.BackendMessage:
        while True:
            msg = await self._receive_raw()
            if msg is None:
                self._closed = True
                raise trio.BrokenResourceError("server closed the connection")
            if isinstance(msg, m.ErrorResponse) and msg.severity in _SESSION_ENDING:
                # The server ends the session after a FATAL error: report it now, and close our
                # side at once (nothing more can come, and a peer that lingers reading until we
                # close is not kept waiting for the caller's aclose()).
                self._closed = True
                await trio.aclose_forcefully(self._stream)
                raise PgError.from_response(msg)
            if not self._asynchronous(msg):
                return msg

    # -- queries ---------------------------------------------------------------------------

    async def execute(self, sql: str) -> list[QueryResult]:
        """Run a simple query (possibly several statements); one result per statement."""
        self._check_idle()
        await self.send_bytes(m.encode(m.Query(sql)))
        results: list[QueryResult] = []
        columns: tuple[str, ...] = ()
        rows: list[Row] = []
        error: PgError | None = None
        while True:
            msg = await self._receive()
            if isinstance(msg, m.RowDescription):
                columns = tuple(f.name for f in msg.fields)
                rows = []
            elif isinstance(msg, m.DataRow):
                rows.append(tuple(_text(v) for v in msg.values))
            elif isinstance(msg, m.CommandComplete):
                results.append(QueryResult(columns, rows, msg.tag))
                columns, rows = (), []
            elif isinstance(msg, m.EmptyQueryResponse):
                continue
            elif isinstance(msg, m.ErrorResponse):
                error = PgError.from_response(msg)
            elif isinstance(msg, m.CopyInResponse):
                await self.send_bytes(m.encode(m.CopyFail("COPY FROM STDIN is not supported by execute()")))
            elif isinstance(msg, m.CopyOutResponse):
                continue  # CopyData follows and is dropped; use copy_out() to read it
            elif isinstance(msg, m.CopyData | m.CopyDone):
                continue
            elif isinstance(msg, m.CopyBothResponse):
                raise LocalProtocolError("query started CopyBoth: use copy_both()")
            elif isinstance(msg, m.ReadyForQuery):
                if error is not None:
                    raise error
                return results
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} in a query response")

    async def query(self, sql: str) -> list[Row]:
        """Rows of the last statement's result, values as text (None for NULL)."""
        results = await self.execute(sql)
        return results[-1].rows if results else []

    async def query_one(self, sql: str) -> Row:
        rows = await self.query(sql)
        if len(rows) != 1:
            raise LocalProtocolError(f"expected one row from {sql!r}, got {len(rows)}")
        return rows[0]

    def _check_idle(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("connection is closed")
        if self._copy is not None:
            raise LocalProtocolError("connection is in COPY mode: finish_copy() first")

    # -- COPY ------------------------------------------------------------------------------

    async def copy_both(self, sql: str) -> CopyBothStream:
        """Send a query that answers CopyBothResponse; return the CopyData stream."""
        return await self._start_copy(sql, m.CopyBothResponse)

    async def copy_out(self, sql: str) -> CopyBothStream:
        """Send a query that answers CopyOutResponse (e.g. BASE_BACKUP); receive-only."""
        return await self._start_copy(sql, m.CopyOutResponse)

    async def _start_copy(
        self, sql: str, expected: type[m.CopyBothResponse] | type[m.CopyOutResponse]
    ) -> CopyBothStream:
        self._check_idle()
        await self.send_bytes(m.encode(m.Query(sql)))
        error: PgError | None = None
        while True:
            msg = await self._receive()
            if isinstance(msg, expected):
                self._copy = CopyBothStream(self, can_send=expected is m.CopyBothResponse)
                return self._copy
            if isinstance(msg, m.ErrorResponse):
                error = PgError.from_response(msg)
            elif isinstance(msg, m.ReadyForQuery):
                raise error or RemoteProtocolError(
                    f"{sql.split()[0] if sql.split() else 'query'} did not start {expected.__name__[:-8]}"
                )
            elif isinstance(msg, m.RowDescription | m.DataRow | m.CommandComplete):
                continue  # result sets some commands send first
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} before COPY")

    def _copy_message(self, stream: CopyBothStream, msg: m.BackendMessage | None) -> bytes | None:
        if isinstance(msg, m.CopyData):
            return msg.data
        if msg is None:
            self._closed = True
            stream.peer_closed = True
            return None
        if isinstance(msg, m.CopyDone):
            stream.peer_done = True
            return None
        if isinstance(msg, m.ErrorResponse):
            # The error ends COPY; ReadyForQuery follows and finish_copy() consumes it, except
            # after a FATAL one: the session is over (no Terminate; aclose() closes the stream).
            stream.peer_done = True
            stream.sent_done = True
            if msg.severity in _SESSION_ENDING:
                self._closed = True
                stream.peer_closed = True
            raise PgError.from_response(msg)
        raise RemoteProtocolError(f"unexpected {type(msg).__name__} during COPY")

    async def copy_receive(self, stream: CopyBothStream) -> bytes | None:
        while True:
            msg = await self._receive_raw()
            if msg is None or not self._asynchronous(msg):
                return self._copy_message(stream, msg)

    def copy_receive_nowait(self, stream: CopyBothStream) -> bytes | None:
        while True:
            ev = self._decoder.next_event()
            if ev is NEED_DATA:
                raise trio.WouldBlock
            msg = None if ev is CLOSED else ev
            if msg is None or not self._asynchronous(msg):
                return self._copy_message(stream, msg)

    async def finish_copy(self) -> list[QueryResult]:
        """End COPY: send CopyDone if we have not, discard CopyData until the server's
        CopyDone, then read the results and ReadyForQuery. Raises a server error."""
        copy = self._copy
        if copy is None:
            raise LocalProtocolError("not in COPY mode")
        if copy.peer_closed:
            raise trio.BrokenResourceError("server closed the connection during COPY")
        if copy.can_send and not copy.sent_done:
            await copy.send_done()
        error: PgError | None = None
        try:
            while not copy.finished_receiving:
                await copy.receive()
        except PgError as exc:  # arrived while draining; an error raised earlier is not repeated
            error = exc
        results: list[QueryResult] = []
        columns: tuple[str, ...] = ()
        rows: list[Row] = []
        while True:
            msg = await self._receive()
            if isinstance(msg, m.RowDescription):
                columns, rows = tuple(f.name for f in msg.fields), []
            elif isinstance(msg, m.DataRow):
                rows.append(tuple(_text(v) for v in msg.values))
            elif isinstance(msg, m.CommandComplete):
                results.append(QueryResult(columns, rows, msg.tag))
            elif isinstance(msg, m.ErrorResponse):
                error = PgError.from_response(msg)
            elif isinstance(msg, m.CopyData | m.CopyDone):
                continue
            elif isinstance(msg, m.ReadyForQuery):
                self._copy = None
                if error is not None:
                    raise error
                return results
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} after COPY")

    # -- lifetime --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Send Terminate (best effort) and close the stream."""
        if not self._closed:
            self._closed = True
            with trio.move_on_after(1.0):
                try:
                    buf = WriteBuffer()
                    m.Terminate().encode(buf)
                    await self._stream.send_all(buf.take())
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                    pass
        await trio.aclose_forcefully(self._stream)

    async def __aenter__(self) -> PgClientConnection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
