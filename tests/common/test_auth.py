"""Tokens: EdDSA pinned, keys from a file or a directory, claims, the permission table."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PrivateKey

from common.auth import (
    AuthError,
    AuthKeyError,
    Claims,
    JwtVerifier,
    Scope,
    Service,
    check_permission,
    check_scope,
    load_public_keys,
)
from protocol.ids import TenantId
from tests.auth_helpers import AuthKit, unsigned_token

T1 = TenantId.parse("11" * 16)
T2 = TenantId.parse("22" * 16)


def test_private_key_is_owner_only(kit: AuthKit) -> None:
    assert stat.S_IMODE(os.stat(kit.private_path).st_mode) == 0o600
    assert b"PRIVATE" not in kit.public_path.read_bytes()


def test_tenant_token_round_trip(kit: AuthKit) -> None:
    v = JwtVerifier.from_key_path(kit.public_path)
    assert v.decode(kit.tenant(T1)) == Claims(Scope.TENANT, T1)
    claims = v.decode(kit.token(Scope.PAGESERVERAPI, ttl_s=3600))
    assert claims.scope is Scope.PAGESERVERAPI and claims.exp is not None


@pytest.mark.parametrize(
    ("case", "kind"),
    [("missing", "missing"), ("malformed", "malformed"), ("forged", "invalid"),
     ("expired", "invalid"), ("alg-none", "invalid")],
)
def test_bad_tokens_refused(kit: AuthKit, case: str, kind: str) -> None:
    v = JwtVerifier.from_key_path(kit.public_path)
    token = kit.refusals(T1, T2, Scope.SAFEKEEPERDATA)[case]
    with pytest.raises(AuthError) as info:
        v.decode(token)
    assert info.value.kind == kind
    assert token == "" or token not in info.value.reason


def test_expiry_has_leeway(kit: AuthKit) -> None:
    v = JwtVerifier.from_key_path(kit.public_path)
    # Expired 30 s ago: inside the 60 s leeway, as Neon.
    assert v.decode(kit.token(Scope.TENANT, T1, ttl_s=10, now=time.time() - 40)).tenant_id == T1


@pytest.mark.parametrize(
    "claims",
    [{"scope": "tenant"}, {"scope": "infra"}, {"scope": "superuser"}, {"tenant_id": "11" * 16},
     {"scope": "tenant", "tenant_id": "xyz"}, {"scope": "tenant", "tenant_id": 5},
     {"scope": "pageserverapi", "aud": "someone"}],
)
def test_bad_claims_refused(kit: AuthKit, claims: dict[str, object]) -> None:
    key = serialization.load_pem_private_key(kit.private_path.read_bytes(), None)
    token = jwt.encode(claims, key, algorithm="EdDSA")  # type: ignore[arg-type]
    with pytest.raises(AuthError) as info:
        JwtVerifier.from_key_path(kit.public_path).decode(token)
    assert info.value.kind == "invalid"


def test_other_algorithms_refused(kit: AuthKit, tmp_path: Path) -> None:
    v = JwtVerifier.from_key_path(kit.public_path)
    # HS256 keyed with the public key's PEM: the classic algorithm-confusion forgery.
    hs = jwt.encode({"scope": "pageserverapi"}, "secret-of-32-bytes-at-the-least!!", algorithm="HS256")
    with pytest.raises(AuthError):
        v.decode(hs)
    with pytest.raises(AuthError):
        v.decode(unsigned_token({"scope": "pageserverapi"}))


def test_ed448_keys_not_loaded(tmp_path: Path) -> None:
    pem = Ed448PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "k.pem").write_bytes(pem)
    with pytest.raises(AuthKeyError, match="not an Ed25519"):
        load_public_keys(tmp_path / "k.pem")


def test_key_directory_rotation(tmp_path: Path) -> None:
    old, new = AuthKit.create(tmp_path / "a"), AuthKit.create(tmp_path / "b")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "old.pem").write_bytes(old.public_path.read_bytes())
    v = JwtVerifier.from_key_path(keys)
    assert v.decode(old.tenant(T1)).tenant_id == T1
    with pytest.raises(AuthError):
        v.decode(new.tenant(T1))
    (keys / "new.pem").write_bytes(new.public_path.read_bytes())
    assert v.reload() == 2
    assert v.decode(new.tenant(T1)).tenant_id == T1
    assert v.decode(old.tenant(T1)).tenant_id == T1
    (keys / "old.pem").unlink()
    v.reload()
    with pytest.raises(AuthError):
        v.decode(old.tenant(T1))
    (keys / "new.pem").unlink()
    with pytest.raises(AuthKeyError, match="no public keys"):
        v.reload()
    assert v.decode(new.tenant(T1)).tenant_id == T1  # a failed reload keeps the keys


PS, SK = Service.PAGESERVER, Service.SAFEKEEPER


@pytest.mark.parametrize(
    ("service", "claims", "tenant", "ok"),
    [
        (PS, Claims(Scope.TENANT, T1), T1, True),
        (PS, Claims(Scope.TENANT, T1), T2, False),
        (PS, Claims(Scope.TENANT, T1), None, False),
        (PS, Claims(Scope.PAGESERVERAPI), T1, True),
        (PS, Claims(Scope.PAGESERVERAPI), None, True),
        (PS, Claims(Scope.SAFEKEEPERDATA), T1, False),
        (PS, Claims(Scope.SAFEKEEPERDATA), None, False),
        (SK, Claims(Scope.TENANT, T1), T1, True),
        (SK, Claims(Scope.TENANT, T1), T2, False),
        (SK, Claims(Scope.TENANT, T1), None, False),
        (SK, Claims(Scope.SAFEKEEPERDATA), T1, True),
        (SK, Claims(Scope.SAFEKEEPERDATA), None, True),
        (SK, Claims(Scope.PAGESERVERAPI), T1, False),
        (SK, Claims(Scope.PAGESERVERAPI), None, False),
        # the storage controller's scopes are valid on it only
        (PS, Claims(Scope.ADMIN), T1, False),
        (PS, Claims(Scope.ADMIN), None, False),
        (PS, Claims(Scope.GENERATIONS_API), None, False),
        (SK, Claims(Scope.ADMIN), T1, False),
        (SK, Claims(Scope.ADMIN), None, False),
        (SK, Claims(Scope.GENERATIONS_API), None, False),
    ],
)
def test_permission_table(service: Service, claims: Claims, tenant: TenantId | None, ok: bool) -> None:
    if ok:
        check_permission(service, claims, tenant)
    else:
        with pytest.raises(AuthError) as info:
            check_permission(service, claims, tenant)
        assert info.value.forbidden


@pytest.mark.parametrize(
    ("claims", "required", "ok"),
    [
        (Claims(Scope.GENERATIONS_API), Scope.GENERATIONS_API, True),
        (Claims(Scope.ADMIN), Scope.GENERATIONS_API, True),  # admin passes everywhere
        (Claims(Scope.ADMIN), Scope.ADMIN, True),
        (Claims(Scope.GENERATIONS_API), Scope.ADMIN, False),  # a pageserver cannot move tenants
        (Claims(Scope.TENANT, T1), Scope.ADMIN, False),
        (Claims(Scope.TENANT, T1), Scope.GENERATIONS_API, False),
        (Claims(Scope.PAGESERVERAPI), Scope.ADMIN, False),
        (Claims(Scope.PAGESERVERAPI), Scope.GENERATIONS_API, False),
        (Claims(Scope.SAFEKEEPERDATA), Scope.GENERATIONS_API, False),
    ],
)
def test_controller_scope_table(claims: Claims, required: Scope, ok: bool) -> None:
    if ok:
        check_scope(claims, required)
    else:
        with pytest.raises(AuthError) as info:
            check_scope(claims, required)
        assert info.value.forbidden


def test_controller_permission_needs_a_route_scope() -> None:
    with pytest.raises(ValueError, match="check_scope"):
        check_permission(Service.STORAGE_CONTROLLER, Claims(Scope.ADMIN), None)
