"""Errors of the WAL kernels, shared by the compiled module and its pure-Python twin."""

from __future__ import annotations

from protocol.errors import RemoteProtocolError

__all__ = ["InvalidWal"]


class InvalidWal(RemoteProtocolError):
    """The bytes are not valid PostgreSQL 15 WAL at this position."""
