"""The redo errors: a request whose page cannot be rebuilt says why, with the record's LSN;
a page whose pointers or items are inconsistent (``PageError``, raised by the page primitives
of ``bufpage`` and by the compiled heap kernel alike)."""

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


class PageError(Exception):
    """A page whose pointers or items are inconsistent, or an item that does not fit it: redo
    cannot continue on it (the manager names the record and its LSN)."""
