"""JWT auth and TLS on a libpq port (common.pgauth, common.pgserver, common.pgclient)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import structlog
import trio
import trio.testing

from common import pgclient
from common.auth import JwtVerifier, Scope, Service
from common.pgauth import JwtAuthenticator
from common.pgserver import PgConnection, PgServer
from common.tls import client_context, server_context
from protocol.ids import TenantId
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError
from tests.auth_helpers import AuthKit, TlsKit

T1 = TenantId.parse("11" * 16)
T2 = TenantId.parse("22" * 16)


class TenantHandler:
    """``touch <tenant>``: a tenant's command; ``global``: a node-wide one."""

    async def handle_query(self, conn: PgConnection, query: str) -> None:
        word, _, arg = query.partition(" ")
        conn.authorize(TenantId.parse(arg) if word == "touch" else None)
        await conn.send_rows(["ok"], [("yes",)])


def jwt_server(kit: AuthKit, **kw: object) -> PgServer:
    auth = JwtAuthenticator(JwtVerifier.from_key_path(kit.public_path), Service.PAGESERVER)
    return PgServer(TenantHandler(), authenticator=auth, **kw)  # type: ignore[arg-type]


async def open_memory(server: PgServer, password: str | None) -> pgclient.PgClientConnection:
    client, server_side = trio.testing.memory_stream_pair()
    trio.lowlevel.spawn_system_task(server.serve_connection, server_side)
    return await pgclient.PgClientConnection.open(client, user="u", password=password)


async def test_tenant_token_admitted(kit: AuthKit) -> None:
    server = jwt_server(kit)
    with trio.fail_after(5):
        conn = await open_memory(server, kit.tenant(T1))
        assert (await conn.query(f"touch {T1.hex}"))[0] == ("yes",)
        await conn.aclose()
        conn = await open_memory(server, kit.token(Scope.PAGESERVERAPI))
        assert (await conn.query(f"touch {T2.hex}"))[0] == ("yes",)
        assert (await conn.query("global"))[0] == ("yes",)
        await conn.aclose()


@pytest.mark.parametrize("case", ["missing", "malformed", "forged", "expired", "alg-none"])
async def test_bad_token_fatal_28p01(kit: AuthKit, case: str) -> None:
    server = jwt_server(kit)
    token = kit.refusals(T1, T2, Scope.SAFEKEEPERDATA)[case]
    with trio.fail_after(5), structlog.testing.capture_logs() as logs, pytest.raises(PgError) as info:
        await open_memory(server, token)
    assert info.value.sqlstate == "28P01" and info.value.severity == "FATAL"
    refused = [e for e in logs if e["event"] == "authentication refused"]
    assert len(refused) == 1 and refused[0]["peer"] == "memory" and refused[0]["reason"]
    assert not token or all(token not in str(v) for e in logs for v in e.values())


@pytest.mark.parametrize("case", ["wrong-scope", "wrong-tenant"])
async def test_command_refused_28000_and_closed(kit: AuthKit, case: str) -> None:
    server = jwt_server(kit)
    token = kit.refusals(T1, T2, Scope.SAFEKEEPERDATA)[case]
    with trio.fail_after(5), structlog.testing.capture_logs() as logs:
        conn = await open_memory(server, token)  # a valid token: the startup succeeds
        with pytest.raises(PgError) as info:
            await conn.query(f"touch {T1.hex}")
        assert info.value.sqlstate == "28000" and info.value.severity == "FATAL"
        with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError, EOFError, PgError)):
            await conn.query("global")  # the server closed the connection
    assert any(e["event"] == "command refused" and e["peer"] == "memory" for e in logs)


async def test_tenant_token_on_node_wide_command_refused(kit: AuthKit) -> None:
    with trio.fail_after(5):
        conn = await open_memory(jwt_server(kit), kit.tenant(T1))
        with pytest.raises(PgError) as info:
            await conn.query("global")
        assert info.value.sqlstate == "28000"


async def test_non_password_answer_is_protocol_violation(kit: AuthKit) -> None:
    client, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(jwt_server(kit).serve_connection, server_side)
            await client.send_all(m.encode(m.StartupMessage({"user": "u"})) + m.encode(m.Query("x")))
            data = b""
            while chunk := await client.receive_some(1000):
                data += chunk
    assert data[:1] == b"R" and b"E" in data[9:10]  # password request, then an ErrorResponse


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


async def test_tls_and_token_over_tcp(kit: AuthKit, tls: TlsKit) -> None:
    server = jwt_server(kit, ssl_context=server_context(tls.cert, tls.key))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        with trio.fail_after(10):
            conn = await pgclient.connect("127.0.0.1", port, user="u", password=kit.tenant(T1),
                                          ssl_context=client_context(tls.ca_cert))
            assert (await conn.query(f"touch {T1.hex}"))[0] == ("yes",)
            await conn.aclose()
            # Plaintext is refused by a TLS server.
            with pytest.raises(PgError, match="TLS"):
                await pgclient.connect("127.0.0.1", port, user="u", password=kit.tenant(T1))
            # A client that trusts another CA refuses the server's certificate.
            other = TlsKit.create(kit.dir / "other-ca")
            with pytest.raises(PgError, match="TLS handshake"):
                await pgclient.connect("127.0.0.1", port, user="u", password=kit.tenant(T1),
                                       ssl_context=client_context(other.ca_cert))
        server.shutdown()


async def test_tls_client_refuses_plaintext_server(kit: AuthKit, tls: TlsKit) -> None:
    server = jwt_server(kit)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        with trio.fail_after(10), pytest.raises(PgError, match="does not support SSL"):
            await pgclient.connect("127.0.0.1", port, user="u", password=kit.tenant(T1),
                                   ssl_context=client_context(tls.ca_cert))
        server.shutdown()


async def test_bytes_after_sslrequest_refused(kit: AuthKit, tls: TlsKit) -> None:
    server = jwt_server(kit, ssl_context=server_context(tls.cert, tls.key))
    client, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_side)
            await client.send_all(m.encode(m.SSLRequest()) + m.encode(m.StartupMessage({"user": "u"})))
            data = b""
            while chunk := await client.receive_some(1000):
                data += chunk
    assert data[:1] == b"E" and b"unencrypted" in data  # no "S": the injection is refused


PSQL = Path("/usr/lib/postgresql/15/bin/psql")


@pytest.mark.skipif(not PSQL.exists(), reason="psql 15 not installed")
async def test_psql_verify_full(kit: AuthKit, tls: TlsKit) -> None:
    server = jwt_server(kit, ssl_context=server_context(tls.cert, tls.key))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)

        def psql(host: str) -> subprocess.CompletedProcess[str]:
            dsn = (f"host={host} port={port} user=u sslmode=verify-full "
                   f"sslrootcert={tls.ca_cert}")
            return subprocess.run(
                [str(PSQL), dsn, "-XAtc", f"touch {T1.hex}"], capture_output=True, text=True,
                env={"PGPASSWORD": kit.tenant(T1), "PATH": "/usr/bin:/bin"}, timeout=20,
            )

        ok = await trio.to_thread.run_sync(psql, "localhost")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == "yes"
        server.shutdown()
