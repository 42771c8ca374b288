"""``PgError``: an error a PostgreSQL peer should see as an ErrorResponse.

Servers: a query handler raises ``PgError(message, sqlstate)`` and the connection loop turns
it into ErrorResponse + ReadyForQuery (severity FATAL closes the connection afterwards).
Clients: an ErrorResponse from the server is raised as ``PgError`` carrying all its fields.

Not a protocol error: the conversation is intact, the request failed.
"""

from __future__ import annotations

from protocol.pgwire import sqlstate
from protocol.pgwire.messages import ErrorResponse


class PgError(Exception):
    def __init__(
        self,
        message: str,
        code: str = sqlstate.INTERNAL_ERROR,
        *,
        severity: str = "ERROR",
        detail: str | None = None,
        hint: str | None = None,
        response: ErrorResponse | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = code
        self.severity = severity
        self.detail = detail
        self.hint = hint
        self.response = response

    def __str__(self) -> str:
        text = f"{self.severity}: {self.message} (SQLSTATE {self.sqlstate})"
        if self.detail:
            text += f"\nDETAIL: {self.detail}"
        return text

    def __repr__(self) -> str:
        return f"PgError({self.message!r}, {self.sqlstate!r}, severity={self.severity!r})"

    @classmethod
    def from_response(cls, resp: ErrorResponse) -> PgError:
        return cls(
            resp.message,
            resp.sqlstate or sqlstate.INTERNAL_ERROR,
            severity=resp.severity or "ERROR",
            detail=resp.detail or None,
            hint=resp.hint or None,
            response=resp,
        )

    def to_response(self) -> ErrorResponse:
        return ErrorResponse.build(
            self.message, self.sqlstate, severity=self.severity, detail=self.detail, hint=self.hint
        )
