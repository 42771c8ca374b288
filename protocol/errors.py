"""Protocol errors, split by whose fault they are (h11's rule).

``RemoteProtocolError``: the peer sent something we cannot accept. It carries the SQLSTATE
the connection boundary puts into an ErrorResponse. ``LocalProtocolError``: we tried to do
something the protocol forbids; that is a bug on our side.
"""

from __future__ import annotations

PROTOCOL_VIOLATION = "08P01"
INTERNAL_ERROR = "XX000"


class ProtocolError(Exception):
    """Base of both protocol errors; ``sqlstate`` is what a PostgreSQL client would see."""

    sqlstate: str

    def __init__(self, msg: str, *, sqlstate: str = PROTOCOL_VIOLATION) -> None:
        super().__init__(msg)
        self.msg = msg
        self.sqlstate = sqlstate

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.msg!r}, sqlstate={self.sqlstate!r})"


class RemoteProtocolError(ProtocolError):
    """The peer violated the protocol (truncated, oversized, unknown tag, bad state...)."""


class LocalProtocolError(ProtocolError):
    """We violated the protocol: a bug in pagestore, never the peer's fault."""

    def __init__(self, msg: str, *, sqlstate: str = INTERNAL_ERROR) -> None:
        super().__init__(msg, sqlstate=sqlstate)
