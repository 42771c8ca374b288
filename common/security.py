"""What a node's listeners need for auth and TLS, built once from its config (docs/auth.md).

Both ports share one ``JwtVerifier`` (one set of keys); ``Trust`` on a port leaves it open.
A key path or certificate that does not load stops the node's start-up with the reason.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs

from common.auth import JwtVerifier, Service
from common.http import HttpAuth
from common.pgauth import JwtAuthenticator
from common.tls import server_context


@attrs.frozen
class NodeSecurity:
    pg_authenticator: JwtAuthenticator | None
    http_auth: HttpAuth | None
    ssl_context: ssl.SSLContext | None

    @classmethod
    def build(
        cls,
        service: Service,
        *,
        pg_auth_type: str,
        http_auth_type: str,
        key_path: Path | None,
        ssl_files: tuple[Path, Path] | None,
    ) -> NodeSecurity:
        verifier: JwtVerifier | None = None
        if "NeonJWT" in (pg_auth_type, http_auth_type):
            if key_path is None:
                raise ValueError("NeonJWT auth needs auth_validation_public_key_path")
            verifier = JwtVerifier.from_key_path(key_path)
        pg = JwtAuthenticator(verifier, service) if verifier and pg_auth_type == "NeonJWT" else None
        http = HttpAuth(verifier, service) if verifier and http_auth_type == "NeonJWT" else None
        ctx = None if ssl_files is None else server_context(*ssl_files)
        return cls(pg, http, ctx)
