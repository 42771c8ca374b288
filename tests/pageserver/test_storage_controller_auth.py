"""Auth and TLS on the storage controller's HTTP API (docs/auth.md): the pageservers' upcalls
need a ``generations_api`` token, its control API (moving and deleting tenants) an ``admin``
token, and ``admin`` passes everywhere; only ``/v1/status`` is open."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import structlog
import trio

from common.auth import Scope
from common.tls import client_context
from control_plane.storage_controller import StorageControllerConfig, serve
from pageserver.control_plane_client import ControlPlaneClient, ControlPlaneRefusedError
from protocol.ids import TenantId
from tests.auth_helpers import AuthKit, TlsKit, http_call

T1 = TenantId.parse("11" * 16)
T2 = TenantId.parse("22" * 16)


def auth_config(tmp_path: Path, kit: AuthKit, **more: object) -> StorageControllerConfig:
    return StorageControllerConfig(workdir=tmp_path / "sc", listen_http_addr="127.0.0.1:0",
                                   http_auth_type="NeonJWT", auth_validation_public_key_path=kit.public_path,
                                   **more)  # type: ignore[arg-type]


async def with_controller(config: StorageControllerConfig, fn: Callable[[int], Awaitable[None]]) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, config)
        await fn(port)
        nursery.cancel_scope.cancel()


async def test_controller_refusals_and_admissions(tmp_path: Path, kit: AuthKit) -> None:
    bad = kit.refusals(T1, T2, Scope.PAGESERVERAPI)
    admin, upcalls = kit.token(Scope.ADMIN), kit.token(Scope.GENERATIONS_API)

    def check(port: int) -> None:
        base = f"http://127.0.0.1:{port}"
        attach = f"{base}/control/v1/tenant/{T1.hex}/attach"
        register = f"{base}/upcall/v1/attach"
        reg_body = {"tenant_id": T1.hex, "node_id": 1}
        assert http_call(f"{base}/v1/status") == (200, {"tenants": 0})  # open
        # 401: no header, not Bearer, empty; on the control API and on an upcall alike.
        for url, body in ((attach, {"node_id": 2}), (register, reg_body)):
            assert http_call(url, "POST", body) == (401, {"msg": "Unauthorized: missing authorization header"})
            assert http_call(url, "POST", body, header=f"Basic {admin}")[0] == 401
            assert http_call(url, "POST", body, header="Bearer")[0] == 401
        # 403: malformed, forged, expired, alg none, and every scope that is not the route's.
        for case in ("malformed", "forged", "expired", "alg-none", "wrong-scope", "wrong-tenant"):
            status, answer = http_call(attach, "POST", {"node_id": 2}, token=bad[case])
            assert status == 403, case
            assert isinstance(answer, dict) and answer["msg"].startswith("Forbidden"), case
        for scope in (Scope.PAGESERVERAPI, Scope.SAFEKEEPERDATA):
            assert http_call(register, "POST", reg_body, token=kit.token(scope))[0] == 403, scope
        assert http_call(register, "POST", reg_body, token=kit.tenant(T1))[0] == 403
        # A pageserver's token cannot move, list or tombstone tenants, nor reload the keys.
        assert http_call(attach, "POST", {"node_id": 2}, token=upcalls)[0] == 403
        assert http_call(f"{base}/control/v1/tenant", token=upcalls)[0] == 403
        assert http_call(f"{base}/control/v1/tenant/{T1.hex}", "DELETE", token=upcalls)[0] == 403
        assert http_call(f"{base}/v1/reload_auth_validation_keys", "POST", {}, token=upcalls)[0] == 403
        # Nothing refused changed anything.
        assert http_call(f"{base}/control/v1/tenant", token=admin) == (200, {"tenants": []})
        # generations_api on the upcalls; admin everywhere.
        assert http_call(register, "POST", reg_body, token=upcalls) == (200, {"gen": 1})
        assert http_call(f"{base}/upcall/v1/re-attach", "POST", {"node_id": 1}, token=admin) == (
            200, {"tenants": [{"id": T1.hex, "gen": 2}]})
        assert http_call(f"{base}/upcall/v1/validate", "POST", {"tenants": [{"id": T1.hex, "gen": 2}]},
                    token=upcalls) == (200, {"tenants": [{"id": T1.hex, "valid": True}]})
        assert http_call(attach, "POST", {"node_id": 2}, token=admin) == (200, {"gen": 3})
        assert http_call(f"{base}/control/v1/tenant/{T1.hex}", "DELETE", token=admin) == (200, {})
        assert http_call(f"{base}/v1/reload_auth_validation_keys", "POST", {}, token=admin) == (200, {"keys": 1})

    async def run(port: int) -> None:
        await trio.to_thread.run_sync(check, port)

    with structlog.testing.capture_logs() as logs:
        await with_controller(auth_config(tmp_path, kit), run)
    refused = [e for e in logs if e["event"] == "http request refused"]
    assert len(refused) == 6 + 6 + 3 + 4  # 401s, bad tokens, wrong scopes on upcalls, upcall token on control
    assert all(e["peer"].startswith("127.0.0.1:") and e["reason"] and e["path"] for e in refused)
    secrets = [t for t in (*bad.values(), admin, upcalls) if t]
    assert not any(t in str(v) for e in logs for v in e.values() for t in secrets)


async def test_pageserver_upcalls_carry_their_token(tmp_path: Path, kit: AuthKit) -> None:
    async def run(port: int) -> None:
        url = f"http://127.0.0.1:{port}/upcall/v1/"
        cp = ControlPlaneClient(url, 1, token=kit.token(Scope.GENERATIONS_API))
        assert await cp.attach(T1) == 1
        assert await cp.re_attach() == {T1: 2}
        assert await cp.validate(T1, 2)
        # Without a token, or with the wrong one, the controller refuses at once (not retried
        # for ever), and an unvalidated generation is "not valid": nothing gets deleted.
        for token in (None, kit.token(Scope.PAGESERVERAPI)):
            anon = ControlPlaneClient(url, 2, token=token)
            with trio.fail_after(5), pytest.raises(ControlPlaneRefusedError, match=r"HTTP 40[13]"):
                await anon.attach(T2)
            with trio.fail_after(5), pytest.raises(ControlPlaneRefusedError):
                await anon.re_attach()
            assert not await anon.validate(T1, 2)

    await with_controller(auth_config(tmp_path, kit), run)


async def test_controller_over_https(tmp_path: Path, kit: AuthKit) -> None:
    tls = TlsKit.create(tmp_path / "tls")

    async def run(port: int) -> None:
        ctx = client_context(tls.ca_cert)
        cp = ControlPlaneClient(f"https://127.0.0.1:{port}/upcall/v1/", 1,
                                token=kit.token(Scope.GENERATIONS_API), ssl_context=ctx)
        assert await cp.attach(T1) == 1
        status = await trio.to_thread.run_sync(
            lambda: http_call(f"https://127.0.0.1:{port}/control/v1/tenant", token=kit.token(Scope.ADMIN), ctx=ctx))
        assert status == (200, {"tenants": [{"id": T1.hex, "gen": 1, "node_id": 1}]})
        with pytest.raises(urllib.error.URLError):  # an unknown CA
            await trio.to_thread.run_sync(lambda: http_call(f"https://127.0.0.1:{port}/v1/status"))

    await with_controller(auth_config(tmp_path, kit, ssl_cert_file=tls.cert, ssl_key_file=tls.key), run)


def test_controller_config_refuses_a_missing_key(tmp_path: Path) -> None:
    from common.auth import AuthKeyError

    config = StorageControllerConfig(workdir=tmp_path, http_auth_type="NeonJWT",
                                     auth_validation_public_key_path=tmp_path / "nope.pem")
    with pytest.raises(AuthKeyError, match="does not exist"):
        config.security()
    with pytest.raises(ValueError, match="needs auth_validation_public_key_path"):
        StorageControllerConfig(workdir=tmp_path, http_auth_type="NeonJWT").security()
