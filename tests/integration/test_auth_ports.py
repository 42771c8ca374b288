"""Auth on every port of real nodes (in-process, TLS on): the pageserver's libpq and HTTP
ports, a safekeeper's libpq and HTTP ports; every refusal case on each, the admissions, a
tenant-A token on tenant B's pagestream, basebackup, fullbackup and WAL push, and psql with
``sslmode=verify-full`` against both nodes (docs/auth.md)."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from common import pgclient
from common.auth import Scope
from common.tls import client_context
from compute.page_client import PageClient
from pageserver.config import PageserverConfig
from pageserver.node import PageserverNode
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from protocol.pagestream import RelTag
from protocol.pgwire.errors import PgError
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, running_node, synthetic_wal
from tests.auth_helpers import AuthKit, TlsKit

PSQL = Path("/usr/lib/postgresql/15/bin/psql")
OTHER = TenantId.parse("ee" * 16)
CASES = ("missing", "malformed", "forged", "expired", "alg-none", "wrong-scope", "wrong-tenant")


@pytest.fixture
def kits(tmp_path: Path) -> tuple[AuthKit, TlsKit]:
    return AuthKit.create(tmp_path / "auth"), TlsKit.create(tmp_path / "tls")


def http(url: str, method: str = "GET", token: str | None = None, body: object = None,
         ctx: ssl.SSLContext | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120, context=ctx) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def expect_refused(connect: Any, query: str | None, case: str) -> None:
    """The connection, or the command on it, is refused with 28P01/28000 and closed."""
    try:
        conn = await connect()
    except PgError as exc:
        assert exc.sqlstate == "28P01" and exc.severity == "FATAL", (case, exc)
        assert case in ("missing", "malformed", "forged", "expired", "alg-none"), case
        return
    assert case in ("wrong-scope", "wrong-tenant"), f"{case}: admitted"
    assert query is not None
    with pytest.raises(PgError) as info:
        await conn.query(query)
    assert info.value.sqlstate == "28000" and info.value.severity == "FATAL", case
    with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError, EOFError, PgError)):
        await conn.query("set a to b")  # the server closed it
    await conn.aclose()


@asynccontextmanager
async def pageserver(workdir: Path, auth: AuthKit, tls: TlsKit) -> AsyncIterator[PageserverNode]:
    conf = PageserverConfig(
        workdir=workdir, listen_pg_addr="127.0.0.1:0", listen_http_addr="127.0.0.1:0",
        pg_auth_type="NeonJWT", http_auth_type="NeonJWT",
        auth_validation_public_key_path=auth.public_path,
        ssl_cert_file=tls.cert, ssl_key_file=tls.key, shutdown_timeout_s=1.0,
    )
    node = PageserverNode(conf)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        try:
            yield node
        finally:
            node.stop()


async def test_pageserver_ports(kits: tuple[AuthKit, TlsKit], pg_tmp_path: Path) -> None:
    auth, tls = kits
    ctx = client_context(tls.ca_cert)
    admin = auth.token(Scope.PAGESERVERAPI)
    async with pageserver(pg_tmp_path / "ps", auth, tls) as node:
        base = f"https://127.0.0.1:{node.http_port}"

        def setup() -> tuple[TenantId, TimelineId, TenantId]:
            # HTTP: node-wide calls need pageserverapi; a tenant token only its own tenant.
            assert http(f"{base}/v1/status", ctx=ctx)[0] == 200
            assert http(f"{base}/metrics", ctx=ctx)[0] == 200
            assert http(f"{base}/v1/tenant", "POST", None, {}, ctx)[0] == 401
            assert http(f"{base}/v1/tenant", "POST", auth.tenant(OTHER), {}, ctx)[0] == 403
            status, a = http(f"{base}/v1/tenant", "POST", admin, {}, ctx)
            assert status == 201, a
            status, b = http(f"{base}/v1/tenant", "POST", admin, {}, ctx)
            assert status == 201, b
            ta, tb = TenantId.parse(a["tenant_id"]), TenantId.parse(b["tenant_id"])
            # The tenant's own token creates its timeline; another tenant's token may not.
            assert http(f"{base}/v1/tenant/{ta.hex}/timeline", "POST", auth.tenant(tb), {}, ctx)[0] == 403
            status, tl = http(f"{base}/v1/tenant/{ta.hex}/timeline", "POST", auth.tenant(ta), {}, ctx)
            assert status == 201, tl
            url = f"{base}/v1/tenant/{ta.hex}/timeline"
            for case, token in auth.refusals(ta, tb, Scope.SAFEKEEPERDATA).items():
                want = 401 if case == "missing" else 403
                assert http(url, token=token or None, ctx=ctx)[0] == want, case
            assert http(url, token=auth.tenant(ta), ctx=ctx)[0] == 200
            assert http(url, token=admin, ctx=ctx)[0] == 200
            assert http(f"{base}/v1/tenant", token=auth.tenant(ta), ctx=ctx)[0] == 403
            return ta, TimelineId.parse(tl["timeline_id"]), tb

        ta, timeline, tb = await trio.to_thread.run_sync(setup)
        port = node.pg_port
        assert port is not None

        def connect(token: str | None) -> Any:
            return lambda: pgclient.connect("127.0.0.1", port, user="u", password=token, ssl_context=ctx)

        with trio.fail_after(60):
            # libpq: every refusal case, on a pagestream of tenant A.
            for case, token in auth.refusals(ta, tb, Scope.SAFEKEEPERDATA).items():
                await expect_refused(connect(token), f"pagestream_v3 {ta.hex} {timeline.hex}", case)
            # A tenant-A token on tenant B's pagestream, basebackup and fullbackup.
            for query in (f"pagestream_v3 {tb.hex} {timeline.hex}", f"basebackup {tb.hex} {timeline.hex}",
                          f"fullbackup {tb.hex} {timeline.hex}"):
                await expect_refused(connect(auth.tenant(ta)), query, "wrong-tenant")
            # Admitted: the tenant's token and pageserverapi read pages and take basebackups.
            rel = RelTag(1663, 1, 1259, 0)  # pg_class of template1
            for token in (auth.tenant(ta), admin):
                async with await PageClient.connect("127.0.0.1", port, ta, timeline, password=token,
                                                    ssl_context=ctx) as client:
                    assert len(await client.get_page(rel, 0)) == 8192
                conn = await connect(token)()
                copy = await conn.copy_out(f"basebackup {ta.hex} {timeline.hex}")
                size = 0
                while (chunk := await copy.receive()) is not None:
                    size += len(chunk)
                await conn.finish_copy()
                await conn.aclose()
                assert size > 100_000
            # No token at all: the client cannot even answer the password request.
            with pytest.raises(PgError, match="password"):
                await connect(None)()
            # Plaintext (no SSLRequest) is refused by a TLS node.
            with pytest.raises(PgError, match="TLS"):
                await pgclient.connect("127.0.0.1", port, user="u", password=auth.tenant(ta))

        if PSQL.exists():
            def psql() -> subprocess.CompletedProcess[str]:
                dsn = f"host=localhost port={port} user=u sslmode=verify-full sslrootcert={tls.ca_cert}"
                return subprocess.run(
                    [str(PSQL), dsn, "-XAtq", "-o", "/dev/null", "-c", f"basebackup {ta.hex} {timeline.hex}"],
                    capture_output=True, text=True, timeout=60,
                    env={"PGPASSWORD": auth.tenant(ta), "PATH": "/usr/bin:/bin"},
                )

            done = await trio.to_thread.run_sync(psql)
            assert done.returncode == 0, done.stderr


@asynccontextmanager
async def safekeeper(data_dir: Path, auth: AuthKit, tls: TlsKit) -> AsyncIterator[SafekeeperNode]:
    async with running_node(
        data_dir, pg_auth_type="NeonJWT", http_auth_type="NeonJWT",
        auth_validation_public_key_path=str(auth.public_path),
        ssl_cert_file=str(tls.cert), ssl_key_file=str(tls.key),
    ) as sk:
        yield sk


async def test_safekeeper_ports(kits: tuple[AuthKit, TlsKit], tmp_path: Path) -> None:
    auth, tls = kits
    ctx = client_context(tls.ca_cert)
    ta, tb = TenantId.parse("aa" * 16), TenantId.parse("bb" * 16)
    timeline = TimelineId.parse("cc" * 16)
    data = auth.token(Scope.SAFEKEEPERDATA)
    async with safekeeper(tmp_path / "sk", auth, tls) as node:
        port = node.pg_port
        assert port is not None

        def connect(token: str | None, tenant: TenantId = ta) -> Any:
            return lambda: pgclient.connect(
                "127.0.0.1", port, user="postgres", password=token, ssl_context=ctx,
                options={"tenant_id": tenant.hex, "timeline_id": timeline.hex},
            )

        with trio.fail_after(60):
            # Push WAL into tenant A with A's token (TLS: the test proposer's connect takes
            # no context, so its connection is made here).
            start = Lsn(WAL_SEGMENT_SIZE)
            conn = await connect(auth.tenant(ta))()
            copy = await conn.copy_both("START_WAL_PUSH (proto_version '3', allow_timeline_creation 'true')")
            async with TestProposer(conn, copy, 3, ta, timeline) as p:
                await p.greet()
                await p.elect(start)
                end = await p.append_many(start, [synthetic_wal(start, 64 * 1024)])
                await p.wait_flush(end)
            # Every refusal case on START_WAL_PUSH (wrong scope: pageserverapi).
            push = "START_WAL_PUSH (proto_version '3')"
            for case, token in auth.refusals(ta, tb, Scope.PAGESERVERAPI).items():
                await expect_refused(connect(token), push, case)
            # A tenant-A token on tenant B's WAL push, replication and IDENTIFY_SYSTEM.
            for query in (push, "START_REPLICATION PHYSICAL 0/1000000", "IDENTIFY_SYSTEM"):
                await expect_refused(connect(auth.tenant(ta), tb), query, "wrong-tenant")
            # The pageserver's token (safekeeperdata) and the tenant's read the WAL back.
            for token in (data, auth.tenant(ta)):
                conn = await connect(token)()
                (row,) = await conn.query("IDENTIFY_SYSTEM")
                assert row[2] is not None
                await conn.aclose()

        base = f"https://127.0.0.1:{node.http_port}"

        def check_http() -> None:
            assert http(f"{base}/v1/status", ctx=ctx)[0] == 200
            assert http(f"{base}/metrics", ctx=ctx)[0] == 200
            url = f"{base}/v1/tenant/{ta.hex}/timeline/{timeline.hex}"
            for case, token in auth.refusals(ta, tb, Scope.PAGESERVERAPI).items():
                want = 401 if case == "missing" else 403
                assert http(url, token=token or None, ctx=ctx)[0] == want, case
            assert http(url, token=auth.tenant(ta), ctx=ctx)[0] == 200
            assert http(url, token=data, ctx=ctx)[0] == 200
            assert http(f"{base}/v1/timelines", token=auth.tenant(ta), ctx=ctx)[0] == 403
            assert http(f"{base}/v1/timelines", token=data, ctx=ctx)[0] == 200

        await trio.to_thread.run_sync(check_http)

        if PSQL.exists():
            def psql() -> subprocess.CompletedProcess[str]:
                dsn = (f"host=localhost port={port} user=postgres sslmode=verify-full "
                       f"sslrootcert={tls.ca_cert} options='-c tenant_id={ta.hex} timeline_id={timeline.hex}'")
                return subprocess.run(
                    [str(PSQL), dsn, "-XAtc", "IDENTIFY_SYSTEM"], capture_output=True, text=True,
                    timeout=60, env={"PGPASSWORD": auth.tenant(ta), "PATH": "/usr/bin:/bin"},
                )

            done = await trio.to_thread.run_sync(psql)
            assert done.returncode == 0, done.stderr
            assert "|1|" in done.stdout


async def test_key_rotation_with_reload(tmp_path: Path) -> None:
    """A key directory: add the new key, reload, both work; drop the old one, reload, the
    old tokens are refused (HTTP and libpq share the keys)."""
    old, new = AuthKit.create(tmp_path / "old"), AuthKit.create(tmp_path / "new")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "old.pem").write_bytes(old.public_path.read_bytes())
    conf = PageserverConfig(
        workdir=tmp_path / "ps", listen_pg_addr="127.0.0.1:0", listen_http_addr="127.0.0.1:0",
        pg_auth_type="NeonJWT", http_auth_type="NeonJWT", auth_validation_public_key_path=keys,
        shutdown_timeout_s=1.0,
    )
    node = PageserverNode(conf)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        base = f"http://127.0.0.1:{node.http_port}"
        old_admin, new_admin = old.token(Scope.PAGESERVERAPI), new.token(Scope.PAGESERVERAPI)
        reload_url = f"{base}/v1/reload_auth_validation_keys"

        def rotate() -> None:
            assert http(f"{base}/v1/tenant", token=old_admin)[0] == 200
            assert http(f"{base}/v1/tenant", token=new_admin)[0] == 403
            (keys / "new.pem").write_bytes(new.public_path.read_bytes())
            assert http(reload_url, "POST", old.tenant(OTHER), {})[0] == 403  # node-wide
            assert http(reload_url, "POST", old_admin, {}) == (200, {"keys": 2})
            assert http(f"{base}/v1/tenant", token=new_admin)[0] == 200
            assert http(f"{base}/v1/tenant", token=old_admin)[0] == 200
            (keys / "old.pem").unlink()
            assert http(reload_url, "POST", new_admin, {}) == (200, {"keys": 1})
            assert http(f"{base}/v1/tenant", token=old_admin)[0] == 403
            (keys / "bad.pem").write_text("not a key")
            status, body = http(reload_url, "POST", new_admin, {})
            assert status == 500 and "bad.pem" in body["msg"]
            assert http(f"{base}/v1/tenant", token=new_admin)[0] == 200  # the keys stayed

        await trio.to_thread.run_sync(rotate)
        port = node.pg_port
        assert port is not None
        with trio.fail_after(20):
            with pytest.raises(PgError) as info:
                await pgclient.connect("127.0.0.1", port, user="u", password=old.tenant(OTHER))
            assert info.value.sqlstate == "28P01"
            conn = await pgclient.connect("127.0.0.1", port, user="u", password=new.tenant(OTHER))
            await conn.aclose()
        node.stop()


def _presented(port: int, ctx: ssl.SSLContext, *, pg: bool) -> bytes:
    """The certificate (DER) a new connection to ``port`` is shown: HTTPS from the first
    byte, or on the libpq port after an SSLRequest."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        if pg:
            raw.sendall((8).to_bytes(4, "big") + (80877103).to_bytes(4, "big"))
            assert raw.recv(1) == b"S"
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return der


async def test_certificate_reload(kits: tuple[AuthKit, TlsKit], tmp_path: Path) -> None:
    """``POST /v1/reload_tls_certificates``: a renewed certificate is presented on both ports
    to new connections without a restart; a key that does not match, or a missing file, is
    refused with 500 and the old pair stays; the route is node-wide (a tenant token: 403)."""
    from common.tls import make_node_cert

    auth, tls = kits
    ctx = client_context(tls.ca_cert)
    async with pageserver(tmp_path / "ps", auth, tls) as node:
        assert node.pg_port is not None and node.http_port is not None
        pg_port, http_port = node.pg_port, node.http_port
        base = f"https://localhost:{http_port}"
        url, admin = f"{base}/v1/reload_tls_certificates", auth.token(Scope.PAGESERVERAPI)

        def renew() -> None:
            first = _presented(pg_port, ctx, pg=True)
            assert _presented(http_port, ctx, pg=False) == first
            renewed_cert, renewed_key = make_node_cert(tls.cert.parent.parent / "ca", tmp_path / "renewed", "test-node")
            old_key = tls.key.read_bytes()
            tls.key.write_bytes(renewed_key.read_bytes())  # a key that does not match the cert
            status, body = http(url, "POST", admin, {}, ctx)
            assert status == 500 and "TLS certificate" in body["msg"]
            tls.key.write_bytes(old_key)
            assert _presented(pg_port, ctx, pg=True) == first  # the old pair stayed
            assert http(url, "POST", auth.tenant(OTHER), {}, ctx)[0] == 403  # node-wide
            tls.cert.write_bytes(renewed_cert.read_bytes())
            tls.key.write_bytes(renewed_key.read_bytes())
            assert http(url, "POST", admin, {}, ctx)[0] == 200
            second = _presented(pg_port, ctx, pg=True)
            assert second != first and _presented(http_port, ctx, pg=False) == second
            tls.cert.unlink()
            assert http(url, "POST", admin, {}, ctx)[0] == 500  # missing: refused, kept
            assert _presented(pg_port, ctx, pg=True) == second

        await trio.to_thread.run_sync(renew)
