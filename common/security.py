"""What a node's listeners need for auth and TLS, built once from its config (docs/auth.md).

Both ports share one ``JwtVerifier`` (one set of keys); ``Trust`` on a port leaves it open.
A key path or certificate that does not load stops the node's start-up with the reason.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import attrs
import structlog
import trio

from common.auth import AuthKeyError, JwtVerifier, Scope, Service
from common.http import HttpAuth, HttpError, Request, Router
from common.pgauth import JwtAuthenticator
from common.tls import reload_server_context, server_context

log = structlog.get_logger("auth")


@attrs.frozen
class NodeSecurity:
    pg_authenticator: JwtAuthenticator | None
    http_auth: HttpAuth | None
    ssl_context: ssl.SSLContext | None
    verifier: JwtVerifier | None = None
    # (ssl_cert_file, ssl_key_file): what ``POST /v1/reload_tls_certificates`` re-reads
    ssl_files: tuple[Path, Path] | None = None

    def add_reload_route(self, router: Router) -> None:
        """``POST /v1/reload_auth_validation_keys`` (node-wide: ``pageserverapi`` on a
        pageserver, ``safekeeperdata`` on a safekeeper, ``admin`` on the storage controller): re-read the key path, so a key added
        to (or removed from) the directory counts without a restart, on both ports. 400 when
        auth is off; 500 naming the problem when the keys do not load (the old ones stay)."""
        verifier = self.verifier

        async def reload(_: Request) -> object:
            if verifier is None:
                raise HttpError(400, "auth is off on this node: there are no keys to reload")
            try:
                count = await trio.to_thread.run_sync(verifier.reload)
            except AuthKeyError as exc:
                raise HttpError(500, f"Error reloading public keys: {exc}") from None
            log.info("auth keys reloaded", keys=count, path=str(verifier.key_path))
            return {"keys": count}

        router.add("POST", "/v1/reload_auth_validation_keys", reload)
        ctx, files = self.ssl_context, self.ssl_files

        async def reload_tls(_: Request) -> object:
            if ctx is None or files is None:
                raise HttpError(400, "TLS is off on this node: there is no certificate to reload")
            try:
                await trio.to_thread.run_sync(reload_server_context, ctx, *files)
            except (OSError, ssl.SSLError) as exc:
                log.warning("TLS certificate reload refused", cert=str(files[0]), reason=str(exc))
                raise HttpError(500, f"Error reloading the TLS certificate: {exc}") from None
            log.info("TLS certificate reloaded", cert=str(files[0]))
            return {"cert": str(files[0])}

        # Node-wide like the key reload (the router's auth checks the scope): a renewed
        # certificate counts for new connections on both ports without a restart.
        router.add("POST", "/v1/reload_tls_certificates", reload_tls)

    @classmethod
    def build(
        cls,
        service: Service,
        *,
        pg_auth_type: str,
        http_auth_type: str,
        key_path: Path | None,
        ssl_files: tuple[Path, Path] | None,
        scope_of: Callable[[str], Scope] | None = None,
    ) -> NodeSecurity:
        """``scope_of``: the HTTP port's routes each need the scope it names for their path
        (the storage controller; ``HttpAuth.scope_of``)."""
        verifier: JwtVerifier | None = None
        if "NeonJWT" in (pg_auth_type, http_auth_type):
            if key_path is None:
                raise ValueError("NeonJWT auth needs auth_validation_public_key_path")
            verifier = JwtVerifier.from_key_path(key_path)
        pg = JwtAuthenticator(verifier, service) if verifier and pg_auth_type == "NeonJWT" else None
        http = (HttpAuth(verifier, service, scope_of=scope_of)
                if verifier and http_auth_type == "NeonJWT" else None)
        ctx = None if ssl_files is None else server_context(*ssl_files)
        return cls(pg, http, ctx, verifier, ssl_files)
