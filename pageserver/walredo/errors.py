"""The redo error: a request whose page cannot be rebuilt says why, with the record's LSN."""

from __future__ import annotations

from protocol.lsn import format_lsn


class RedoError(Exception):
    """A record could not be replayed on the requested page (unsupported rmgr, corrupt data...)."""

    def __init__(self, msg: str, *, lsn: int | None = None, rmgr: str | None = None) -> None:
        where = f" (record ending at {format_lsn(lsn)})" if lsn is not None else ""
        super().__init__(f"{msg}{where}")
        self.msg = msg
        self.lsn = lsn
        self.rmgr = rmgr


class RedoValidationError(RedoError):
    """validate_redo: the replayed page differs (masked) from PostgreSQL's verification image."""
