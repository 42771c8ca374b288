"""Runs of continuing AppendRequests, decoded as one: the safekeeper receive path's kernel.

``coalesce_appends(payloads, k, max_bytes)`` (contract in ``protocol/_pq_py.py``) is the
compiled ``protocol/_pq_c.pyx`` or its pure-Python twin, as ``protocol._native`` selects.
``decode_append_run`` wraps it: the run as one ``AppendRequest`` whose ``messages`` says how
many wire messages it stands for, or None when ``payloads[k]`` must be decoded alone.

Why this is the same as decoding each message: the acceptor checks every append of a run
against the same generation and term, each one starts where the previous ended, and of their
``commit_lsn`` and ``truncate_lsn`` it keeps only the maxima; the WAL is written as one
contiguous piece either way (a write group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from protocol import _native
from protocol.lsn import Lsn
from protocol.safekeeper import AppendRequest

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "coalesce_appends", "decode_append_run"]

_native.require("protocol._pq_c")
if _native.IMPL == "python":
    from protocol._pq_py import IMPL, coalesce_appends
else:
    from protocol._pq_c import IMPL, coalesce_appends


def decode_append_run(payloads: Sequence[Buffer], k: int, max_bytes: int) -> AppendRequest | None:
    """The run of v3 AppendRequests at ``payloads[k]`` as one request (at least two
    messages, at most ``max_bytes`` of WAL), or None."""
    count, term, gen, begin, end, commit, trunc, wal = coalesce_appends(payloads, k, max_bytes)
    if count < 2:
        return None
    return AppendRequest(
        term, Lsn(begin), Lsn(end), Lsn(commit), Lsn(trunc), wal, generation=gen, messages=count
    )
