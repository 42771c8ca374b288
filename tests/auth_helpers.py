"""Keys, tokens and certificates for the auth tests (docs/auth.md)."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import attrs

from common.auth import Scope, encode_token, generate_keypair, load_private_key
from common.tls import make_local_ca, make_node_cert
from protocol.ids import TenantId


@attrs.frozen
class AuthKit:
    """A keypair in ``dir`` and a second, unrelated one (for forged tokens)."""

    dir: Path
    private_path: Path
    public_path: Path
    other_private_path: Path

    @classmethod
    def create(cls, dir: Path) -> AuthKit:
        priv, pub = generate_keypair(dir / "keys")
        other, _ = generate_keypair(dir / "other")
        return cls(dir, priv, pub, other)

    def token(self, scope: Scope, tenant_id: TenantId | None = None, ttl_s: float | None = None,
              now: float | None = None) -> str:
        return encode_token(load_private_key(self.private_path), scope, tenant_id, ttl_s=ttl_s, now=now)

    def tenant(self, tenant_id: TenantId) -> str:
        return self.token(Scope.TENANT, tenant_id)

    def forged(self, tenant_id: TenantId) -> str:
        return encode_token(load_private_key(self.other_private_path), Scope.TENANT, tenant_id)

    def expired(self, tenant_id: TenantId) -> str:
        # Expired by more than the 60 s leeway.
        return self.token(Scope.TENANT, tenant_id, ttl_s=60, now=1_000_000)

    def refusals(self, tenant_id: TenantId, other_tenant: TenantId, wrong_scope: Scope) -> dict[str, str]:
        """Every refused token, by case name ("missing" is the empty password)."""
        return {
            "missing": "",
            "malformed": "not-a-jwt",
            "forged": self.forged(tenant_id),
            "expired": self.expired(tenant_id),
            "alg-none": unsigned_token({"scope": "tenant", "tenant_id": tenant_id.hex}),
            "wrong-scope": self.token(wrong_scope),
            "wrong-tenant": self.tenant(other_tenant),
        }


def unsigned_token(claims: dict[str, object]) -> str:
    """A token with ``alg: none`` and no signature (what a verifier must refuse)."""

    def part(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


@attrs.frozen
class TlsKit:
    ca_cert: Path
    cert: Path
    key: Path

    @classmethod
    def create(cls, dir: Path) -> TlsKit:
        ca_cert, _ = make_local_ca(dir / "ca")
        cert, key = make_node_cert(dir / "ca", dir / "node", "test-node")
        return cls(ca_cert, cert, key)


def http_call(url: str, method: str = "GET", body: object | None = None, *, token: str | None = None,
              header: str | None = None, ctx: ssl.SSLContext | None = None) -> tuple[int, object]:
    """One HTTP request (``body`` sent as JSON) with a bearer ``token`` or a raw
    ``Authorization`` ``header``: (status, the answer), a JSON answer parsed, any other as bytes."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if header is not None:
        req.add_header("Authorization", header)
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            answer = resp.read()
            return resp.status, json.loads(answer) if resp.headers["content-type"] == "application/json" else answer
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
