"""The libpq server loop: our own client over memory streams, plus psycopg and the real psql."""

from __future__ import annotations

import hashlib
import random
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import psycopg
import pytest
import structlog
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common.pgserver as pgserver
from common.linger import LINGER_S
from common.pgclient import PgClientConnection, connect
from common.pgserver import (
    CleartextPasswordAuthenticator,
    Column,
    PgConnection,
    PgServer,
    PgServerConfig,
)
from common.tls import client_context, server_context
from protocol.errors import RemoteProtocolError
from protocol.pgwire import CLOSED, NEED_DATA, BackendDecoder, FrontendDecoder, sqlstate
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError
from tests.auth_helpers import TlsKit

PSQL = "/usr/lib/postgresql/15/bin/psql"


class Handler:
    """A test handler exercising every answer kind."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, str], str]] = []
        self.copy_ended: list[str] = []
        self.view_batches: list[int] = []

    async def handle_query(self, conn: PgConnection, query: str) -> None:
        self.seen.append((conn.startup_params, conn.options, query))
        words = query.strip().rstrip(";").split()
        if query.lower().startswith("select"):
            await conn.send_rows(
                [Column("n", m.OID_INT4), "s", "nothing"], [(1, "one", None), (2, "two", None)]
            )
        elif words[:1] == ["fail"]:
            raise PgError("you asked for it", sqlstate.SYNTAX_ERROR, detail="details")
        elif words[:1] == ["crash"]:
            conn.bind_log(tenant_id="t1")
            raise RuntimeError("handler bug")
        elif words[:1] == ["group_fail"]:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                raise RemoteProtocolError("bad payload", sqlstate=sqlstate.PROTOCOL_VIOLATION)
        elif words[:1] == ["sleep"]:
            await trio.sleep(float(words[1]))
            await conn.send_command_complete("SLEEP")
        elif words[:1] == ["echo"]:
            # Reader and writer as separate tasks, like the safekeeper and the page service.
            copy = await conn.enter_copy_both("ECHO")
            send, recv = trio.open_memory_channel[bytes](4)

            async def writer() -> None:
                async with recv:
                    async for payload in recv:
                        if payload == b"bad":
                            raise RemoteProtocolError("bad payload in copy", sqlstate="22023")
                        await copy.send_many([payload, payload.upper()])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                async with send:
                    while (payload := await copy.receive()) is not None:
                        await send.send(payload)
            self.copy_ended.append("closed" if copy.peer_closed else "done")
        elif words[:1] == ["stream"]:
            copy = await conn.enter_copy_both("STREAM")
            await copy.send_many(f"chunk {i}".encode() for i in range(int(words[1])))
            await copy.send_done()
            while await copy.receive() is not None:
                pass
        elif words[:1] == ["views"]:
            # The zero-copy receive: hold every view until the end, then report what they
            # show, so that a receive buffer reused under a live view would be caught.
            copy = await conn.enter_copy_both("VIEWS")
            held: list[memoryview] = []
            batches = 0
            while (batch := await conn.copy_receive_views(copy)) is not None:
                assert batch and all(isinstance(v, memoryview) for v in batch)
                held += batch
                batches += 1
            digest = hashlib.sha256()
            for v in held:
                digest.update(len(v).to_bytes(4, "big"))
                digest.update(v)
            self.view_batches.append(batches)
            await copy.send(digest.digest())
        elif words[:1] == ["fatal_copy"]:
            # A push the server gives up on after its first message (as the safekeeper does on
            # a WAL write error) while the client is still sending.
            copy = await conn.enter_copy_both("FATAL_COPY")
            await copy.receive()
            raise PgError("could not write", "58030", severity="FATAL")
        elif words[:1] == ["basebackup"]:
            out = await conn.enter_copy_out("BASEBACKUP")
            for i in range(3):
                await out.send(b"tar%d" % i)
        elif words[:1] == ["set"]:
            return  # nothing sent: the loop answers CommandComplete "SET"
        else:
            raise PgError(f"unknown command {query!r}", sqlstate.SYNTAX_ERROR)


@pytest.fixture
def handler() -> Handler:
    return Handler()


@asynccontextmanager
async def tcp_server(
    handler: Handler, config: PgServerConfig | None = None, authenticator: CleartextPasswordAuthenticator | None = None
) -> AsyncIterator[PgServer]:
    server = PgServer(handler, config, authenticator=authenticator)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield server
        server.shutdown()


@asynccontextmanager
async def memory_client(
    server: PgServer, **kw: str
) -> AsyncIterator[tuple[PgClientConnection, trio.abc.Stream]]:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_connection, server_stream)
        conn = await PgClientConnection.open(client_stream, user=kw.pop("user", "tester"), **kw)  # type: ignore[arg-type]
        yield conn, client_stream
        await conn.aclose()


async def test_rows_error_and_options_over_memory_stream(handler: Handler) -> None:
    server = PgServer(handler)
    with trio.fail_after(5):
        async with memory_client(
            server, options="-c tenant_id=abc timeline_id=def", dbname="db"
        ) as (conn, _):
            assert conn.server_params["server_version"] == "15.0 (pagestore)"
            assert conn.server_params["integer_datetimes"] == "on"
            assert conn.server_params["client_encoding"] == "UTF8"
            assert conn.backend_key is not None
            result = await conn.execute("select")
            assert result[0].columns == ("n", "s", "nothing")
            assert result[0].rows == [("1", "one", None), ("2", "two", None)]
            assert result[0].command_tag == "SELECT 2"
            with pytest.raises(PgError) as info:
                await conn.query("fail")
            assert (info.value.sqlstate, info.value.message, info.value.detail) == (
                "42601",
                "you asked for it",
                "details",
            )
            assert (await conn.execute("set x = 1"))[0].command_tag == "SET"
            assert await conn.query("select") == [("1", "one", None), ("2", "two", None)]
    params, options, _ = handler.seen[0]
    assert params["database"] == "db"
    assert options == {"tenant_id": "abc", "timeline_id": "def"}


async def test_handler_bug_becomes_internal_error_and_connection_survives(handler: Handler) -> None:
    server = PgServer(handler)
    with structlog.testing.capture_logs() as logs, trio.fail_after(5):
        async with memory_client(server) as (conn, _):
            with pytest.raises(PgError) as info:
                await conn.query("crash")
            assert info.value.sqlstate == "XX000"
            assert "handler bug" in info.value.message
            with pytest.raises(PgError) as info:
                await conn.query("group_fail")  # a one-member exception group is unwrapped
            assert info.value.sqlstate == "08P01"
            assert info.value.message == "bad payload"
            assert len(await conn.query("select")) == 2
    assert any(e["event"] == "query handler failed" for e in logs)


async def test_copy_both_echo_with_concurrent_reader_and_writer(handler: Handler) -> None:
    server = PgServer(handler)
    with trio.fail_after(5):
        async with memory_client(server) as (conn, _):
            copy = await conn.copy_both("echo")
            got = []
            for i in range(20):
                await copy.send(f"msg{i}".encode())
            for _ in range(40):
                payload = await copy.receive()
                assert payload is not None
                got.append(payload)
            assert got[:4] == [b"msg0", b"MSG0", b"msg1", b"MSG1"]
            results = await conn.finish_copy()
            assert results[-1].command_tag == "ECHO"
            # The connection is back in the query loop.
            assert len(await conn.query("select")) == 2
            # A payload the handler refuses ends COPY with its SQLSTATE; the connection lives.
            copy = await conn.copy_both("echo")
            await copy.send(b"bad")
            with pytest.raises(PgError) as info:
                await copy.receive()
            assert info.value.sqlstate == "22023"
            await conn.finish_copy()
            assert len(await conn.query("select")) == 2
    assert handler.copy_ended == ["done"]


async def test_copy_both_server_ends_stream(handler: Handler) -> None:
    server = PgServer(handler)
    with trio.fail_after(5):
        async with memory_client(server) as (conn, _):
            copy = await conn.copy_both("stream 5")
            got = []
            while (payload := await copy.receive()) is not None:
                got.append(payload)
            assert got == [f"chunk {i}".encode() for i in range(5)]
            assert copy.peer_done
            await conn.finish_copy()
            assert len(await conn.query("select")) == 2


async def test_copy_out(handler: Handler) -> None:
    server = PgServer(handler)
    with trio.fail_after(5):
        async with memory_client(server) as (conn, _):
            out = await conn.copy_out("basebackup")
            got = []
            while (chunk := await out.receive()) is not None:
                got.append(chunk)
            assert got == [b"tar0", b"tar1", b"tar2"]
            assert (await conn.finish_copy())[-1].command_tag == "BASEBACKUP"
            assert len(await conn.query("select")) == 2


async def test_copy_client_eof_closes_quietly(handler: Handler) -> None:
    server = PgServer(handler)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_stream)
            conn = await PgClientConnection.open(client_stream, user="u")
            copy = await conn.copy_both("echo")
            await copy.send(b"x")
            assert await copy.receive() == b"x"
            await client_stream.aclose()
    assert handler.copy_ended == ["closed"]
    assert server.connection_count == 0


async def _raw_exchange(stream: trio.abc.Stream, data: bytes, until: type) -> list[object]:
    """Send raw bytes, collect server messages until one of type ``until`` (or EOF)."""
    await stream.send_all(data)
    decoder = BackendDecoder()
    out: list[object] = []
    while True:
        ev = decoder.next_event()
        if ev is NEED_DATA:
            decoder.receive_data(await stream.receive_some(65536))
            continue
        if ev is CLOSED:
            out.append(CLOSED)
            return out
        out.append(ev)
        if isinstance(ev, until):
            return out


async def test_ssl_gssenc_refused_then_startup_and_extended_protocol_rejected(
    handler: Handler,
) -> None:
    server = PgServer(handler)
    client, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_side)
            await client.send_all(m.encode(m.SSLRequest()))
            assert await client.receive_some(1) == b"N"
            await client.send_all(m.encode(m.GSSENCRequest()))
            assert await client.receive_some(1) == b"N"
            msgs = await _raw_exchange(
                client, m.encode(m.StartupMessage({"user": "u"})), m.ReadyForQuery
            )
            assert isinstance(msgs[0], m.AuthenticationOk)
            # Parse/Bind/Execute: one error, everything up to Sync skipped, then ReadyForQuery.
            extended = m.encode(
                m.Parse("", "select 1"), m.Bind("", ""), m.Describe("P", ""), m.Execute(""), m.Sync()
            )
            msgs = await _raw_exchange(client, extended, m.ReadyForQuery)
            assert len(msgs) == 2
            assert isinstance(msgs[0], m.ErrorResponse) and msgs[0].sqlstate == "0A000"
            # Flush alone is harmless; Sync alone answers ReadyForQuery.
            msgs = await _raw_exchange(client, m.encode(m.Flush(), m.Sync()), m.ReadyForQuery)
            assert msgs == [m.ReadyForQuery("I")]
            msgs = await _raw_exchange(client, m.encode(m.Query("select")), m.ReadyForQuery)
            assert [type(x) for x in msgs] == [
                m.RowDescription, m.DataRow, m.DataRow, m.CommandComplete, m.ReadyForQuery
            ]
            msgs = await _raw_exchange(client, m.encode(m.Terminate()), m.ReadyForQuery)
            assert msgs == [CLOSED]


async def test_garbage_on_one_connection_closes_only_it(handler: Handler) -> None:
    with trio.fail_after(30):
        async with tcp_server(handler) as server:
            assert server.port is not None
            good = await connect("127.0.0.1", server.port, user="good")
            bad = await trio.open_tcp_stream("127.0.0.1", server.port)
            await _raw_exchange(bad, m.encode(m.StartupMessage({"user": "bad"})), m.ReadyForQuery)
            msgs = await _raw_exchange(bad, b"\x01garbage garbage garbage", m.ErrorResponse)
            err = msgs[0]
            assert isinstance(err, m.ErrorResponse)
            assert (err.severity, err.sqlstate) == ("FATAL", "08P01")
            assert "unknown client message tag" in err.message
            assert await _raw_exchange(bad, b"", m.ReadyForQuery) == [CLOSED]
            # Garbage before the startup packet too.
            worse = await trio.open_tcp_stream("127.0.0.1", server.port)
            msgs = await _raw_exchange(worse, b"\xff\xff\xff\xff" * 4, m.ErrorResponse)
            assert isinstance(msgs[0], m.ErrorResponse) and msgs[0].sqlstate == "08P01"
            assert len(await good.query("select")) == 2
            await good.aclose()
            await bad.aclose()
            await worse.aclose()


async def test_copy_receive_views_over_tcp_keeps_every_view_intact(handler: Handler) -> None:
    """The socket path: recv_into the decoder's buffer, CopyData framed as views; messages
    split across receives and larger than a receive, Sync/Flush in between, several
    receive arrays used while all earlier views are still held."""
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 100, 8192, 128 * 1024, 300_000, 3_000_000]) for _ in range(60)]
    payloads = [rng.randbytes(n) for n in sizes]
    expected = hashlib.sha256()
    for p in payloads:
        expected.update(len(p).to_bytes(4, "big"))
        expected.update(p)
    assert sum(sizes) > 3 * 2 * 1024 * 1024  # more than a few receive arrays
    with trio.fail_after(30):
        async with tcp_server(handler) as server:
            assert server.port is not None
            conn = await connect("127.0.0.1", server.port, user="views")
            copy = await conn.copy_both("views")
            wire = bytearray()
            for i, p in enumerate(payloads):
                wire += m.encode(m.CopyData(p))
                if i % 7 == 3:
                    wire += m.encode(m.Flush()) + m.encode(m.Sync())
            # Odd-sized writes with pauses: frames split anywhere between receives.
            pos = 0
            while pos < len(wire):
                step = rng.randint(1, 400_000)
                await conn.transport.send_all(wire[pos : pos + step])
                pos += step
                if rng.random() < 0.2:
                    await trio.sleep(0.005)
            await copy.send_done()
            assert await copy.receive() == expected.digest()
            assert (await conn.finish_copy())[-1].command_tag == "VIEWS"
            assert len(await conn.query("select")) == 2
            await conn.aclose()
    assert handler.view_batches and handler.view_batches[0] > 1


async def test_a_fatal_error_reaches_a_client_that_is_still_sending(handler: Handler) -> None:
    """The server ends a COPY with FATAL while megabytes the client sent are still unread.
    Closing with unread bytes makes the kernel answer with a reset, which can destroy the
    ErrorResponse before the client reads it; the server closes its sending side first and
    drains what the client still sends (bounded), so the client reads the FATAL and then EOF."""
    with trio.fail_after(20):
        async with tcp_server(handler) as server:
            assert server.port is not None
            for _ in range(5):
                stream = await trio.open_tcp_stream("127.0.0.1", server.port)
                await _raw_exchange(stream, m.encode(m.StartupMessage({"user": "u"})), m.ReadyForQuery)
                await _raw_exchange(stream, m.encode(m.Query("fatal_copy")), m.CopyBothResponse)
                piece = m.encode(*[m.CopyData(bytes(8192))] * 8)
                for _ in range(64):  # 4 MiB, more than both socket buffers
                    await stream.send_all(piece)
                msgs = await _raw_exchange(stream, b"", m.ErrorResponse)
                err = msgs[-1]
                assert isinstance(err, m.ErrorResponse), msgs
                assert (err.sqlstate, err.severity) == ("58030", "FATAL")
                assert await stream.receive_some(65536) == b""  # then an orderly end
                await stream.aclose()


async def test_a_lingering_connection_does_not_hold_the_servers_shutdown(handler: Handler) -> None:
    """A client that read the FATAL and neither closes nor sends keeps the server's side
    lingering; a shutdown ends that at once rather than after the linger's bound."""
    with trio.fail_after(10):
        async with tcp_server(handler) as server:
            assert server.port is not None
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await _raw_exchange(stream, m.encode(m.StartupMessage({"user": "u"})), m.ReadyForQuery)
            await _raw_exchange(stream, m.encode(m.Query("fatal_copy")), m.CopyBothResponse)
            msgs = await _raw_exchange(stream, m.encode(m.CopyData(b"x")), m.ErrorResponse)
            assert isinstance(msgs[-1], m.ErrorResponse)
            while server.connection_count:  # the FATAL is out: the connection's close lingers
                await trio.sleep(0.01)
            started = trio.current_time()
        assert trio.current_time() - started < LINGER_S / 2
        assert await stream.receive_some(65536) == b""  # the server's FIN came with the FATAL
        await stream.aclose()


def _push_until_fatal_over_tls(port: int, ca: Path) -> tuple[list[object], bytes]:
    """A blocking TLS client (its own thread): startup, ``fatal_copy``, 4 MiB of CopyData
    sent without reading, then every message up to the ErrorResponse and what follows it."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with raw:
        raw.sendall(m.encode(m.SSLRequest()))
        assert raw.recv(1) == b"S"
        with client_context(ca).wrap_socket(raw, server_hostname="localhost") as sock:
            decoder = BackendDecoder()

            def until(kind: type) -> list[object]:
                out: list[object] = []
                while True:
                    ev = decoder.next_event()
                    if ev is NEED_DATA:
                        decoder.receive_data(sock.recv(65536))
                        continue
                    out.append(ev)
                    if ev is CLOSED or isinstance(ev, kind):
                        return out

            sock.sendall(m.encode(m.StartupMessage({"user": "u"})))
            until(m.ReadyForQuery)
            sock.sendall(m.encode(m.Query("fatal_copy")))
            until(m.CopyBothResponse)
            piece = m.encode(*[m.CopyData(bytes(8192))] * 8)
            for _ in range(64):
                sock.sendall(piece)
            msgs = until(m.ErrorResponse)
            return msgs, sock.recv(65536)


async def test_a_fatal_error_reaches_a_tls_client_that_is_still_sending(
    handler: Handler, tmp_path: Path
) -> None:
    """The same over TLS: close_notify, then the lingering close on the socket beneath."""
    kit = TlsKit.create(tmp_path)
    server = PgServer(handler, PgServerConfig(), ssl_context=server_context(kit.cert, kit.key))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            for _ in range(3):
                msgs, rest = await trio.to_thread.run_sync(_push_until_fatal_over_tls, port, kit.ca_cert)
                err = msgs[-1]
                assert isinstance(err, m.ErrorResponse), msgs
                assert (err.sqlstate, err.severity) == ("58030", "FATAL")
                assert rest == b""  # then EOF (a bare FIN reads the same: the FATAL is the proof)
            server.shutdown()


async def test_idle_timeout_on_a_socket(handler: Handler) -> None:
    """The recv_into path honours the idle timeout as receive_some did."""
    with trio.fail_after(10):
        async with tcp_server(handler, PgServerConfig(idle_timeout_s=0.3)) as server:
            assert server.port is not None
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await _raw_exchange(stream, m.encode(m.StartupMessage({"user": "idle"})), m.ReadyForQuery)
            msgs = await _raw_exchange(stream, b"", m.ErrorResponse)
            err = msgs[0]
            assert isinstance(err, m.ErrorResponse) and err.sqlstate == "57P05"
            await stream.aclose()


async def _until_handler_saw(handler: Handler, query: str) -> None:
    """Wait until the server runs ``query`` (a fixed sleep races with a loaded machine)."""
    while not any(seen_query == query for _, _, seen_query in handler.seen):
        await trio.sleep(0.01)


async def test_shutdown_sends_57p01_and_enforces_deadline(handler: Handler) -> None:
    # The deadline is generous so that a loaded machine cannot reach it; ending well before it
    # still proves handlers were cancelled at shutdown rather than left to the deadline.
    server = PgServer(handler, PgServerConfig(shutdown_timeout_s=30))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            idle = await connect("127.0.0.1", port, user="idle")
            busy = await connect("127.0.0.1", port, user="busy")
            await busy.send_bytes(m.encode(m.Query("sleep 1000")))
            await _until_handler_saw(handler, "sleep 1000")
            start = trio.current_time()
            server.shutdown()
            for conn in (idle, busy):
                msgs = await _raw_exchange(conn.transport, b"", m.ReadyForQuery)
                err = msgs[0]
                assert isinstance(err, m.ErrorResponse)
                assert (err.severity, err.sqlstate) == ("FATAL", "57P01")
                assert msgs[1:] == [CLOSED]
        # serve() returned: every connection ended well before the deadline.
        assert trio.current_time() - start < 30
        assert server.connection_count == 0
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)


async def test_idle_timeout(handler: Handler, autojump_clock: trio.testing.MockClock) -> None:
    server = PgServer(handler, PgServerConfig(idle_timeout_s=30))
    async with memory_client(server) as (conn, stream):
        await trio.sleep(10)
        assert len(await conn.query("select")) == 2  # activity resets the timer
        start = trio.current_time()
        msgs = await _raw_exchange(stream, b"", m.ErrorResponse)
        assert trio.current_time() - start == pytest.approx(30)
        err = msgs[0]
        assert isinstance(err, m.ErrorResponse) and err.sqlstate == "57P05"


async def test_startup_timeout(handler: Handler, autojump_clock: trio.testing.MockClock) -> None:
    server = PgServer(handler, PgServerConfig(startup_timeout_s=3))
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_connection, server_side)
        await client.send_all(b"\x00\x00")  # half a length word, then nothing
        assert await client.receive_some(10) == b""  # closed by the server


async def test_cleartext_password(handler: Handler) -> None:
    auth = CleartextPasswordAuthenticator(lambda user, pw: (user, pw) == ("alice", "secret"))
    server = PgServer(handler, authenticator=auth)
    with trio.fail_after(5):
        async with memory_client(server, user="alice", password="secret") as (conn, _):
            assert len(await conn.query("select")) == 2
        client, server_side = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_side)
            with pytest.raises(PgError) as info:
                await PgClientConnection.open(client, user="alice", password="wrong")
            assert info.value.sqlstate == "28P01"


async def test_missing_user_is_fatal(handler: Handler) -> None:
    server = PgServer(handler)
    client, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_side)
            msgs = await _raw_exchange(client, m.encode(m.StartupMessage({})), m.ErrorResponse)
            assert isinstance(msgs[0], m.ErrorResponse) and msgs[0].sqlstate == "28000"


async def test_log_context_bound_per_connection(handler: Handler) -> None:
    capture = structlog.testing.LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        server = PgServer(handler)
        with trio.fail_after(5):
            async with memory_client(server) as (conn, _):
                with pytest.raises(PgError):
                    await conn.query("crash")
    finally:
        structlog.reset_defaults()
    failed = [e for e in capture.entries if e["event"] == "query handler failed"]
    assert len(failed) == 1
    assert failed[0]["conn_id"] >= 1
    assert (failed[0]["peer"], failed[0]["user"], failed[0]["tenant_id"]) == ("memory", "tester", "t1")
    assert structlog.contextvars.get_contextvars() == {}


# -- real libpq clients --------------------------------------------------------------------


def _psycopg_session(port: int) -> Iterator[object]:
    with psycopg.connect(
        host="127.0.0.1", port=port, user="pg", dbname="x", autocommit=True, connect_timeout=30
    ) as conn:
        yield conn.execute("select 1").fetchall()
        try:
            conn.execute("fail")
        except psycopg.Error as exc:
            yield (type(exc).__name__, exc.sqlstate, str(exc))
        try:
            conn.execute("select %s", (1,))  # extended protocol
        except psycopg.Error as exc:
            yield (type(exc).__name__, exc.sqlstate)
        yield conn.execute("select 2").fetchall()
        yield conn.info.server_version


async def test_psycopg_client(handler: Handler) -> None:
    with trio.fail_after(60):
        async with tcp_server(handler) as server:
            assert server.port is not None
            port = server.port
            results = await trio.to_thread.run_sync(lambda: list(_psycopg_session(port)))
    rows = [(1, "one", None), (2, "two", None)]  # psycopg parses the int4 column
    assert results[0] == rows
    assert results[1] == ("SyntaxError", "42601", "you asked for it\nDETAIL:  details")
    assert results[2] == ("FeatureNotSupported", "0A000")
    assert results[3] == rows
    assert results[4] == 150000


@pytest.mark.postgres
async def test_psql_client(handler: Handler) -> None:
    with trio.fail_after(60):
        async with tcp_server(handler) as server:
            args = [PSQL, "-X", "-h", "127.0.0.1", "-p", str(server.port), "-U", "someone", "-A"]
            ok = await trio.run_process(
                [*args, "-c", "select"], capture_stdout=True, capture_stderr=True, check=False
            )
            bad = await trio.run_process(
                [*args, "-c", "fail"], capture_stdout=True, capture_stderr=True, check=False
            )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.decode().splitlines() == ["n|s|nothing", "1|one|", "2|two|", "(2 rows)"]
    assert bad.returncode == 1
    assert "ERROR:  you asked for it" in bad.stderr.decode()
    assert handler.seen[0][0]["application_name"] == "psql"


async def test_cancel_request_cancels_running_query(handler: Handler) -> None:
    with trio.fail_after(30):
        async with tcp_server(handler) as server:
            assert server.port is not None
            conn = await connect("127.0.0.1", server.port)
            await conn.send_bytes(m.encode(m.Query("sleep 1000")))
            # A cancel that arrives before the query runs is (as in PostgreSQL) a no-op.
            await _until_handler_saw(handler, "sleep 1000")
            key = conn.backend_key
            assert key is not None
            canceller = await trio.open_tcp_stream("127.0.0.1", server.port)
            await canceller.send_all(m.encode(m.CancelRequest(key.process_id, key.secret_key)))
            assert await canceller.receive_some(10) == b""
            msgs = await _raw_exchange(conn.transport, b"", m.ReadyForQuery)
            err = msgs[0]
            assert isinstance(err, m.ErrorResponse) and err.sqlstate == "57014"
            assert len(await conn.query("select")) == 2
            await conn.aclose()
            await canceller.aclose()


async def test_serve_connection_in_caller_task_restores_log_context(handler: Handler) -> None:
    server = PgServer(handler)
    client, server_side = trio.testing.memory_stream_pair()

    async def client_side() -> None:
        conn = await PgClientConnection.open(client, user="u")
        with pytest.raises(PgError):
            await conn.query("crash")  # binds tenant_id inside the connection
        await conn.aclose()

    structlog.contextvars.bind_contextvars(outer=1)
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client_side)
                await server.serve_connection(server_side)
        assert structlog.contextvars.get_contextvars() == {"outer": 1}
    finally:
        structlog.contextvars.clear_contextvars()


async def test_an_idle_socket_connection_releases_its_receive_buffer(
    handler: Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection waiting for its client longer than IDLE_RELEASE_S holds no receive
    memory; it receives normally again afterwards, and the idle timeout still counts from
    the start of the wait."""
    monkeypatch.setattr(pgserver, "IDLE_RELEASE_S", 0.05)
    conns: list[PgConnection] = []
    real_register = PgServer._register

    def register(self: PgServer, conn: PgConnection) -> None:
        conns.append(conn)
        real_register(self, conn)

    monkeypatch.setattr(PgServer, "_register", register)
    with trio.fail_after(10):
        async with tcp_server(handler, PgServerConfig(idle_timeout_s=0.6)) as server:
            assert server.port is not None
            conn = await connect("127.0.0.1", server.port, user="idle")
            assert len(await conn.query("select")) == 2
            (server_conn,) = conns
            assert server_conn._decoder.receive_capacity >= pgserver.RECEIVE_MIN
            await trio.sleep(0.3)
            assert server_conn._decoder.receive_capacity == 0
            assert len(await conn.query("select")) == 2
            await trio.sleep(0.3)
            assert len(await conn.query("select")) == 2
            # Quiet beyond the idle timeout (0.6 s) in total: closed with 57P05.
            stream = conn.transport
            msgs = await _raw_exchange(stream, b"", m.ErrorResponse)
            err = msgs[0]
            assert isinstance(err, m.ErrorResponse) and err.sqlstate == "57P05"
            await stream.aclose()


# -- the socket receive path (recv_into the decoder's window) -----------------------------


def _general_copy_payloads(wire: bytes) -> list[bytes]:
    """CopyData payloads of ``wire`` as the general decoder sees them (message by message,
    no views, no socket), up to CopyDone."""
    decoder = FrontendDecoder()
    decoder.receive_data(m.encode(m.StartupMessage({"user": "general"})) + wire)
    assert isinstance(decoder.next_event(), m.StartupMessage)
    out: list[bytes] = []
    while True:
        ev = decoder.next_event()
        assert ev is not NEED_DATA and ev is not CLOSED
        if isinstance(ev, m.CopyData):
            out.append(bytes(ev.data))
        elif isinstance(ev, m.CopyDone):
            return out


async def _socket_connection() -> tuple[PgConnection, trio.socket.SocketType]:
    """A server connection over a real socket (so the recv fast path runs), past startup
    and in COPY, and the raw client end."""
    server_sock, client = trio.socket.socketpair()
    conn = PgConnection(PgServer(Handler()), trio.SocketStream(server_sock), 1, "socketpair")
    await client.send(m.encode(m.StartupMessage({"user": "fast"})))
    with trio.fail_after(5):
        assert isinstance(await conn.receive_message(), m.StartupMessage)
    return conn, client


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 70_000, 300_000]), min_size=1, max_size=12),
    cuts=st.lists(st.integers(1, 200_000), min_size=1, max_size=30),
    pauses=st.lists(st.booleans(), min_size=1, max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_socket_receive_agrees_with_the_general_decoder_on_any_chunking(
    sizes: list[int], cuts: list[int], pauses: list[bool], seed: int
) -> None:
    """Whatever way the client's bytes arrive on the socket (cut anywhere, sometimes with
    the server finding the socket empty and waiting), the views the server hands out are
    the payloads the general decoder finds in the same bytes, and no view changes later."""
    rng = random.Random(seed)
    wire = bytearray()
    for i, n in enumerate(sizes):
        wire += m.encode(m.CopyData(rng.randbytes(n)))
        if i % 3 == 1:
            wire += m.encode(m.Sync()) + m.encode(m.Flush())
    wire += m.encode(m.CopyDone())
    expected = _general_copy_payloads(bytes(wire))

    async def run() -> list[bytes]:
        conn, client = await _socket_connection()
        copy = await conn.enter_copy_both()
        held: list[memoryview] = []
        snapshots: list[bytes] = []

        async def sender() -> None:
            view = memoryview(wire)
            least = len(view) // 40 + 1  # at most ~40 sends (and pauses) per example
            pos = 0
            k = 0
            while pos < len(view):
                pos += await client.send(view[pos : pos + max(cuts[k % len(cuts)], least)])
                if pauses[k % len(pauses)]:
                    await trio.sleep(0.001)  # the server finds the socket empty
                k += 1

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                while (batch := await conn.copy_receive_views(copy)) is not None:
                    held += batch
                    snapshots += [bytes(v) for v in batch]
        assert [bytes(v) for v in held] == snapshots  # nothing changed under a live view
        client.close()
        await conn.transport.aclose()
        return snapshots

    assert trio.run(run) == expected


async def test_a_receive_that_does_not_wait_is_still_a_checkpoint() -> None:
    """Bytes already queued on the socket are received without waiting, and that receive
    still lets other tasks run and cancellations land (as trio's recv_into does)."""
    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    await client.send(m.encode(m.CopyData(b"queued")))
    await trio.testing.wait_all_tasks_blocked()
    with trio.testing.assert_checkpoints(), trio.fail_after(5):
        views = await conn.copy_receive_views(copy)
    assert views is not None and [bytes(v) for v in views] == [b"queued"]
    await client.send(m.encode(m.CopyData(b"more")))
    with trio.CancelScope() as scope:
        scope.cancel()
        await conn.copy_receive_views(copy)
    assert scope.cancelled_caught
    # The cancelled call had already taken the bytes into the decoder: nothing is lost.
    views = await conn.copy_receive_views(copy)
    assert views is not None and [bytes(v) for v in views] == [b"more"]
    client.close()
    await conn.transport.aclose()


async def test_socket_errors_map_to_the_stream_exceptions() -> None:
    """A reset connection gives BrokenResourceError, a socket closed under the connection
    ClosedResourceError, and EOF in the middle of a message 08P01 (what trio's
    SocketStream and the decoder raised before the fast path)."""
    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    # SO_LINGER 0: close() sends a RST instead of a FIN.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    with pytest.raises(trio.BrokenResourceError), trio.fail_after(5):
        await conn.copy_receive_views(copy)
    await conn.transport.aclose()

    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    conn.transport.socket.close()  # type: ignore[attr-defined]
    with pytest.raises(trio.ClosedResourceError), trio.fail_after(5):
        await conn.copy_receive_views(copy)
    client.close()

    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    await client.send(m.encode(m.CopyData(b"x" * 100))[:50])
    client.shutdown(socket.SHUT_WR)  # a FIN (close() would reset: our replies are unread)
    with pytest.raises(RemoteProtocolError) as info, trio.fail_after(5):
        await conn.copy_receive_views(copy)
    assert info.value.sqlstate == sqlstate.PROTOCOL_VIOLATION
    client.close()
    await conn.transport.aclose()

    # EOF while the server waits for the socket: a clean end of the COPY stream.
    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def end_later() -> None:
                await trio.testing.wait_all_tasks_blocked()
                client.shutdown(socket.SHUT_WR)

            nursery.start_soon(end_later)
            assert await conn.copy_receive_views(copy) is None
    assert copy.peer_closed
    client.close()
    await conn.transport.aclose()


async def test_copy_receive_scan_takes_frames_in_place_and_releases_memory_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel form of the COPY receive, on a real socket: the scanner consumes what it
    understands straight from the receive buffer (``[]`` back), anything else comes back as
    a payload, CopyDone ends it; while the client is idle the connection gives back its
    receive memory and calls the scanner's ``release_idle_memory`` too."""
    monkeypatch.setattr(pgserver, "IDLE_RELEASE_S", 0.05)
    conn, client = await _socket_connection()
    copy = await conn.enter_copy_both()
    taken: list[bytes] = []
    idle: list[int] = []

    class Scanner:
        def __call__(self, data: bytearray, start: int, end: int, max_length: int) -> int:
            # takes complete CopyData messages whose payload starts with "k"
            while end - start >= 6 and data[start] == ord("d") and data[start + 5] == ord("k"):
                length = int.from_bytes(data[start + 1 : start + 5], "big")
                if length > end - start - 1:
                    break
                taken.append(bytes(data[start + 5 : start + 1 + length]))
                start += 1 + length
            return start

        def release_idle_memory(self) -> None:
            idle.append(conn._decoder.receive_capacity)

    scanner = Scanner()
    with trio.fail_after(5):
        await client.send(m.encode(m.CopyData(b"keep 1"), m.CopyData(b"keep 2"), m.CopyData(b"other")))
        assert await conn.copy_receive_scan(copy, scanner) == []
        assert taken == [b"keep 1", b"keep 2"]
        views = await conn.copy_receive_scan(copy, scanner)
        assert views is not None and [bytes(v) for v in views] == [b"other"]
        del views
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(0.3)
                await client.send(m.encode(m.CopyData(b"keep 3"), m.CopyDone()))

            nursery.start_soon(later)
            assert await conn.copy_receive_scan(copy, scanner) == []
        assert idle and idle[0] == 0  # after the connection let go of its receive buffer
        assert taken[-1] == b"keep 3"
        assert await conn.copy_receive_scan(copy, scanner) is None
    client.close()
