"""Bearer tokens and TLS on the HTTP server (common.http ``HttpAuth``)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
import structlog
import trio

from common.auth import JwtVerifier, Scope, Service
from common.http import HttpAuth, HttpServer, Request, Router
from common.metrics import add_metrics_route, new_registry
from common.tls import client_context, server_context
from protocol.ids import TenantId
from tests.auth_helpers import AuthKit, TlsKit, http_call

T1 = TenantId.parse("11" * 16)
T2 = TenantId.parse("22" * 16)


def router() -> Router:
    r = Router()

    @r.route("GET", "/v1/status")
    async def status(_: Request) -> object:
        return {"ok": True}

    @r.route("GET", "/v1/tenant")
    async def tenants(_: Request) -> object:
        return ["all"]

    @r.route("DELETE", "/v1/tenant/{tenant_id}")
    async def delete(req: Request) -> object:
        return {"deleted": req.params["tenant_id"]}

    add_metrics_route(r, new_registry())
    return r


async def run(server: HttpServer, fn: object) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        await trio.to_thread.run_sync(fn, port)  # type: ignore[arg-type]
        server.shutdown()


async def test_http_refusals_and_admissions(kit: AuthKit) -> None:
    auth = HttpAuth(JwtVerifier.from_key_path(kit.public_path), Service.PAGESERVER)
    server = HttpServer(router(), auth=auth)
    bad = kit.refusals(T1, T2, Scope.SAFEKEEPERDATA)

    def check(port: int) -> None:
        base = f"http://127.0.0.1:{port}"
        tenant_url = f"{base}/v1/tenant/{T1.hex}"
        # Open endpoints.
        assert http_call(f"{base}/v1/status")[0] == 200
        assert http_call(f"{base}/metrics")[0] == 200
        # 401: no header, not Bearer, empty.
        assert http_call(tenant_url, "DELETE") == (401, {"msg": "Unauthorized: missing authorization header"})
        assert http_call(tenant_url, "DELETE", header=f"Basic {kit.tenant(T1)}")[0] == 401
        assert http_call(tenant_url, "DELETE", header="Bearer")[0] == 401
        # 403: malformed, forged, expired, alg none, wrong scope, wrong tenant.
        for case in ("malformed", "forged", "expired", "alg-none", "wrong-scope", "wrong-tenant"):
            status, body = http_call(tenant_url, "DELETE", token=bad[case])
            assert status == 403, case
            assert isinstance(body, dict) and body["msg"].startswith("Forbidden"), case
        # A tenant token: its own tenant only, never node-wide.
        assert http_call(tenant_url, "DELETE", token=kit.tenant(T1)) == (200, {"deleted": T1.hex})
        assert http_call(f"{base}/v1/tenant", token=kit.tenant(T1))[0] == 403
        # pageserverapi: everything.
        assert http_call(f"{base}/v1/tenant", token=kit.token(Scope.PAGESERVERAPI))[0] == 200
        assert http_call(tenant_url, "DELETE", token=kit.token(Scope.PAGESERVERAPI))[0] == 200

    with structlog.testing.capture_logs() as logs:
        await run(server, check)
    refused = [e for e in logs if e["event"] == "http request refused"]
    assert len(refused) == 10  # 3 x 401, 7 x 403
    assert all(e["peer"].startswith("127.0.0.1:") and e["reason"] for e in refused)
    tokens = [t for t in bad.values() if t]
    assert not any(t in str(v) for e in logs for v in e.values() for t in tokens)


async def test_https_verified(kit: AuthKit, tmp_path: Path) -> None:
    tls = TlsKit.create(tmp_path / "tls")
    auth = HttpAuth(JwtVerifier.from_key_path(kit.public_path), Service.SAFEKEEPER)
    server = HttpServer(router(), auth=auth, ssl_context=server_context(tls.cert, tls.key))

    def check(port: int) -> None:
        ctx = client_context(tls.ca_cert)
        assert http_call(f"https://localhost:{port}/v1/status", ctx=ctx)[0] == 200
        assert http_call(f"https://127.0.0.1:{port}/v1/tenant", token=kit.token(Scope.SAFEKEEPERDATA),
                    ctx=ctx)[0] == 200
        with pytest.raises(urllib.error.URLError):  # an unknown CA
            http_call(f"https://127.0.0.1:{port}/v1/status")

    await run(server, check)
