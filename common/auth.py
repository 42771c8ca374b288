"""Tenant-scoped JWTs: the tokens every pagestore port checks (docs/auth.md).

Owns the token format and the permission rules; the libpq and HTTP glue that carries tokens
lives in ``common.pgauth`` and ``common.http``.

- Tokens are EdDSA (Ed25519) JWTs, verified with PyJWT. The algorithm is pinned to
  ``EdDSA`` here, never taken from the token's header; ``none``, HMAC and RSA tokens are
  refused. Only Ed25519 public keys are loaded (PyJWT's EdDSA would also take Ed448).
- Claims: ``scope`` (required; one of ``Scope``), ``tenant_id`` (required for ``tenant``),
  ``exp`` (optional; enforced with 60 s leeway when present). A token with ``aud`` is refused
  (no audience is configured). ``nbf`` and ``iat`` are not checked (Neon's rules).
- Public keys come from ``auth_validation_public_key_path``: one PEM file, or a directory
  whose every regular file is one (rotation: add the new key, reload, drop the old one).

Permission (``check_permission``): a ``tenant`` token may touch its own tenant's data only,
never node-wide operations; ``pageserverapi`` may do everything on a pageserver and nothing
on a safekeeper; ``safekeeperdata`` everything on a safekeeper and nothing on a pageserver.
The storage controller (``check_scope``, Neon's rule) asks each route for one exact scope:
``generations_api`` for the pageservers' upcalls, ``admin`` for its control API; an ``admin``
token passes everywhere on it, and neither scope is valid on a pageserver or a safekeeper.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

# PyJWT and cryptography are imported where a key or a token is handled, not here: every
# command that only names a Scope (the CLI's endpoint start, a node's config) would pay
# their import (~0.1 s of CPU) for nothing.

ALGORITHM = "EdDSA"  # pinned: the only algorithm a token may use
LEEWAY_S = 60
PRIVATE_KEY_NAME = "auth_private_key.pem"
PUBLIC_KEY_NAME = "auth_public_key.pem"
# Environment variable a node or a client reads its own token from (never a command-line
# argument: ``ps`` shows those to every user of the machine).
TOKEN_ENV = "PAGESTORE_AUTH_TOKEN"
# A pageserver's ``generations_api`` token for its upcalls to the storage controller (Neon's
# ``control_plane_api_token``), beside its ``safekeeperdata`` token in TOKEN_ENV.
CONTROL_PLANE_TOKEN_ENV = "PAGESTORE_CONTROL_PLANE_API_TOKEN"


class Scope(enum.Enum):
    TENANT = "tenant"
    PAGESERVERAPI = "pageserverapi"
    SAFEKEEPERDATA = "safekeeperdata"
    # The storage controller's: the pageservers' upcalls (re-attach, attach, validate) ...
    GENERATIONS_API = "generations_api"
    # ... and its control API (moving and deleting tenants), what the CLI holds.
    ADMIN = "admin"


class Service(enum.Enum):
    """Which node checks the token: the permission table differs."""

    PAGESERVER = "pageserver"
    SAFEKEEPER = "safekeeper"
    STORAGE_CONTROLLER = "storage_controller"


class AuthError(Exception):
    """A refused token.

    ``public`` is what the client is told (it never says which key or why a signature
    failed); ``reason`` goes to the server's log. ``kind`` is one of ``missing``,
    ``header`` (HTTP: not ``Bearer <token>``), ``malformed``, ``invalid`` (bad signature, algorithm, claims, expired) and ``forbidden``
    (a valid token whose scope or tenant does not cover the request).
    """

    def __init__(self, kind: str, public: str, reason: str | None = None) -> None:
        super().__init__(public)
        self.kind = kind
        self.public = public
        self.reason = reason or public

    @property
    def forbidden(self) -> bool:
        return self.kind == "forbidden"


@attrs.frozen
class Claims:
    scope: Scope
    tenant_id: TenantId | None = None
    exp: int | None = None

    def describe(self) -> str:
        """For log lines: scope and tenant, nothing secret."""
        if self.tenant_id is not None:
            return f"{self.scope.value}:{self.tenant_id.hex}"
        return self.scope.value


# -- keys -------------------------------------------------------------------------------------


class AuthKeyError(Exception):
    """A key file that cannot be used; the message names it."""


def _load_public_key(path: Path) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise AuthKeyError(f"{path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AuthKeyError(f"{path}: not an Ed25519 public key ({type(key).__name__})")
    return key


def load_public_keys(path: Path) -> list[Ed25519PublicKey]:
    """The Ed25519 public keys at ``path`` (a PEM file, or a directory of them, one level)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        keys = [_load_public_key(p) for p in files]
    elif path.exists():
        keys = [_load_public_key(path)]
    else:
        raise AuthKeyError(f"auth_validation_public_key_path {path} does not exist")
    if not keys:
        raise AuthKeyError(f"no public keys in {path}")
    return keys


def generate_keypair(directory: Path) -> tuple[Path, Path]:
    """A new Ed25519 keypair: ``auth_private_key.pem`` (PKCS#8, mode 0600, written so that it
    is never readable by others, not even for a moment) and ``auth_public_key.pem`` (SPKI)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    priv_path = directory / PRIVATE_KEY_NAME
    pub_path = directory / PUBLIC_KEY_NAME
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_secret(priv_path, pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv_path, pub_path


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte (replacing the file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise AuthKeyError(f"{path}: cannot read the private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AuthKeyError(f"{path}: not an Ed25519 private key")
    return key


# -- tokens -----------------------------------------------------------------------------------


def encode_token(
    key: Ed25519PrivateKey,
    scope: Scope,
    tenant_id: TenantId | None = None,
    *,
    ttl_s: float | None = None,
    now: float | None = None,
) -> str:
    """A signed token; ``ttl_s=None`` mints one without ``exp`` (the nodes' own tokens)."""
    if scope is Scope.TENANT and tenant_id is None:
        raise ValueError("a tenant token needs a tenant_id")
    claims: dict[str, Any] = {"scope": scope.value}
    if tenant_id is not None:
        claims["tenant_id"] = tenant_id.hex
    issued = time.time() if now is None else now
    claims["iat"] = int(issued)
    if ttl_s is not None:
        claims["exp"] = int(issued + ttl_s)
    import jwt

    return jwt.encode(claims, key, algorithm=ALGORITHM)


def _claims_from(payload: dict[str, Any]) -> Claims:
    raw_scope = payload.get("scope")
    try:
        scope = Scope(raw_scope)
    except ValueError:
        raise AuthError("invalid", "invalid token", f"unknown scope {raw_scope!r}") from None
    tenant_id: TenantId | None = None
    raw_tenant = payload.get("tenant_id")
    if raw_tenant is not None:
        if not isinstance(raw_tenant, str):
            raise AuthError("invalid", "invalid token", "tenant_id is not a string")
        try:
            tenant_id = TenantId.parse(raw_tenant)
        except RemoteProtocolError:
            raise AuthError("invalid", "invalid token", f"bad tenant_id {raw_tenant[:40]!r}") from None
    if scope is Scope.TENANT and tenant_id is None:
        raise AuthError("invalid", "invalid token", "tenant scope without tenant_id")
    exp = payload.get("exp")
    return Claims(scope, tenant_id, exp if isinstance(exp, int) else None)


class JwtVerifier:
    """Verifies tokens against the public keys of one key path; ``reload()`` re-reads it."""

    def __init__(self, keys: Sequence[Ed25519PublicKey], key_path: Path | None = None) -> None:
        if not keys:
            raise AuthKeyError("no public keys to verify tokens with")
        self._keys = list(keys)
        self.key_path = key_path

    @classmethod
    def from_key_path(cls, path: Path) -> JwtVerifier:
        return cls(load_public_keys(path), path)

    def reload(self) -> int:
        """Read the key path again (rotation); returns how many keys are in use. A path that
        no longer loads leaves the old keys in place and raises ``AuthKeyError``."""
        if self.key_path is None:
            raise AuthKeyError("these keys were not loaded from a path")
        self._keys = load_public_keys(self.key_path)
        return len(self._keys)

    def decode(self, token: str | None) -> Claims:
        """The token's claims, or ``AuthError`` (missing / malformed / invalid)."""
        if not token:
            raise AuthError("missing", "no token: send a JWT as the password (libpq) or as "
                            "'Authorization: Bearer' (HTTP)")
        if token.count(".") != 2 or len(token) > 8192:
            raise AuthError("malformed", "malformed token", "not a JWT (three dot-separated parts)")
        import jwt

        options: dict[str, Any] = {
            "require": ["scope"],
            "verify_nbf": False,
            "verify_iat": False,
            "verify_exp": True,
        }
        last: Exception | None = None
        for key in self._keys:
            try:
                payload = jwt.decode(
                    token,
                    key,
                    algorithms=[ALGORITHM],
                    options=options,  # type: ignore[arg-type]
                    leeway=LEEWAY_S,
                )
            except jwt.InvalidSignatureError as exc:
                last = exc  # maybe the next key (rotation)
                continue
            except jwt.ExpiredSignatureError:
                raise AuthError("invalid", "token expired") from None
            except jwt.DecodeError as exc:
                raise AuthError("malformed", "malformed token", str(exc)) from None
            except jwt.InvalidTokenError as exc:
                raise AuthError("invalid", "invalid token", f"{type(exc).__name__}: {exc}") from None
            if not isinstance(payload, dict):
                raise AuthError("malformed", "malformed token", "payload is not an object")
            return _claims_from(payload)
        raise AuthError("invalid", "invalid token", f"signature matches no key ({last})")


# -- permissions ------------------------------------------------------------------------------


def check_permission(service: Service, claims: Claims, tenant_id: TenantId | None) -> None:
    """May ``claims`` act on ``tenant_id`` (``None``: a node-wide operation) on ``service``?
    Raises ``AuthError("forbidden", ...)`` if not."""
    if claims.scope is Scope.TENANT:
        if tenant_id is None:
            raise AuthError("forbidden", "a tenant token may not use node-wide operations")
        if claims.tenant_id != tenant_id:
            raise AuthError(
                "forbidden",
                f"the token is not valid for tenant {tenant_id.hex}",
                f"token of tenant {claims.tenant_id.hex if claims.tenant_id else None} "
                f"used for tenant {tenant_id.hex}",
            )
        return
    if service is Service.STORAGE_CONTROLLER:
        raise ValueError("the storage controller's routes name their scope: use check_scope")
    allowed = Scope.PAGESERVERAPI if service is Service.PAGESERVER else Scope.SAFEKEEPERDATA
    if claims.scope is not allowed:
        raise AuthError(
            "forbidden", f"a {claims.scope.value} token is not valid on the {service.value}"
        )


def check_scope(claims: Claims, required: Scope) -> None:
    """The storage controller's rule: a route needs exactly ``required``, or ``admin``.
    Raises ``AuthError("forbidden", ...)`` if the token has neither."""
    if claims.scope is not required and claims.scope is not Scope.ADMIN:
        raise AuthError(
            "forbidden",
            f"a {claims.scope.value} token is not valid here (this call needs {required.value})",
        )
