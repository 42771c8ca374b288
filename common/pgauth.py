"""JWT authentication on a libpq port (``common.pgserver``'s ``Authenticator``).

The token travels as the password: the server asks AuthenticationCleartextPassword, the
client answers a PasswordMessage holding the JWT (``PGPASSWORD=$(pagestore token ...)`` for
psql). A missing, malformed, forged or expired token ends the connection with FATAL 28P01
(invalid_password); a valid token used for a tenant or command it does not cover ends it with
FATAL 28000 (invalid_authorization_specification). Each refusal is one warning log line with
the peer and the reason, never the token.
"""

from __future__ import annotations

import structlog
import trio

from common.auth import AuthError, Claims, JwtVerifier, Service, check_permission
from common.pgserver import PgConnection
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId
from protocol.pgwire import messages as m
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError

log = structlog.get_logger("auth")


class JwtAuthenticator:
    """Checks the token at startup and every tenant's command against its claims."""

    def __init__(self, verifier: JwtVerifier, service: Service) -> None:
        self.verifier = verifier
        self.service = service

    async def authenticate(self, conn: PgConnection) -> None:
        await conn.send_message(m.AuthenticationCleartextPassword())
        msg = await conn.receive_message()
        if msg is None:
            log.warning("authentication refused", peer=conn.peer, kind="missing",
                        reason="the client closed the connection instead of sending a token")
            raise trio.BrokenResourceError("client closed during authentication")
        if not isinstance(msg, m.PasswordMessage):
            raise RemoteProtocolError(f"expected a password (the JWT), got {type(msg).__name__}")
        try:
            conn.claims = self.verifier.decode(msg.password)
        except AuthError as exc:
            log.warning("authentication refused", peer=conn.peer, kind=exc.kind, reason=exc.reason)
            raise PgError(
                f"JWT authentication error: {exc.public}", sqlstate.INVALID_PASSWORD, severity="FATAL"
            ) from None
        assert isinstance(conn.claims, Claims)
        conn.bind_log(claims=conn.claims.describe())

    def authorize(self, conn: PgConnection, tenant_id: TenantId | None) -> None:
        claims = conn.claims
        try:
            if not isinstance(claims, Claims):
                raise AuthError("forbidden", "not authenticated")
            check_permission(self.service, claims, tenant_id)
        except AuthError as exc:
            log.warning("command refused", peer=conn.peer, kind=exc.kind, reason=exc.reason,
                        tenant_id=tenant_id.hex if tenant_id else None)
            raise PgError(
                f"permission denied: {exc.public}",
                sqlstate.INVALID_AUTHORIZATION_SPECIFICATION,
                severity="FATAL",
            ) from None
