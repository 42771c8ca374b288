"""Runs of continuing AppendRequests, decoded as one: the safekeeper receive path's kernel.

``coalesce_appends(payloads, k, max_bytes)`` (contract in ``protocol/_pq_py.py``) is the
compiled ``protocol/_pq_c.pyx`` or its pure-Python twin, as ``protocol._native`` selects.
``decode_append_run`` wraps it: the run as one ``AppendRequest`` whose ``messages`` says how
many wire messages it stands for, or None when ``payloads[k]`` must be decoded alone.

``AppendRunTaker`` is the receive path without per-message objects: handed to
``PgConnection.copy_receive_scan``, it runs ``take_append_run`` (same contract file) over the
connection's raw receive buffer, which frames the CopyData messages, decodes their
AppendRequest headers and copies the run's WAL into one of a few reused output buffers, all in
one call. A buffer is reused only once nothing refers to it any more (the run's WAL view
lives until its write group was written), so a run's bytes never change under it.

Why this is the same as decoding each message: the acceptor checks every append of a run
against the same generation and term, each one starts where the previous ended, and of their
``commit_lsn`` and ``truncate_lsn`` it keeps only the maxima; the WAL is written as one
contiguous piece either way (a write group).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from protocol import _native
from protocol.lsn import Lsn
from protocol.safekeeper import MAX_SEND_SIZE, AppendRequest

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "AppendRunTaker", "coalesce_appends", "decode_append_run", "take_append_run"]

_native.require("protocol._pq_c")
if _native.IMPL == "python":
    from protocol._pq_py import IMPL, coalesce_appends, take_append_run
else:
    from protocol._pq_c import IMPL, coalesce_appends, take_append_run


def decode_append_run(payloads: Sequence[Buffer], k: int, max_bytes: int) -> AppendRequest | None:
    """The run of v3 AppendRequests at ``payloads[k]`` as one request (at least two
    messages, at most ``max_bytes`` of WAL), or None."""
    count, term, gen, begin, end, commit, trunc, wal = coalesce_appends(payloads, k, max_bytes)
    if count < 2:
        return None
    return AppendRequest(
        term, Lsn(begin), Lsn(end), Lsn(commit), Lsn(trunc), wal, generation=gen, messages=count
    )


class AppendRunTaker:
    """The scanner ``PgConnection.copy_receive_scan`` runs over the receive buffer: each call
    takes at most one run of continuing v3 AppendRequests (at most ``run_bytes`` of WAL),
    which ``take()`` then returns as one ``AppendRequest`` whose ``wal`` is a view of an
    arena of this taker's pool.

    Runs are packed one after the other into the current arena: a run holds only what was
    received when it was taken (often much less than ``run_bytes``), so an arena per run
    would pin far more memory than the WAL in flight. An arena is left when less than one
    largest message (``MAX_SEND_SIZE``) of room remains, and reused once no view of it is
    left (its last run was written)."""

    __slots__ = ("_arena", "_arena_size", "_at", "_pool", "_run", "run_bytes")

    # Arenas kept for reuse. The safekeeper's byte budget (ingest_queue_bytes) bounds the WAL
    # queued or being written, hence the arenas in use (runs are packed); beyond this many,
    # an arena is not kept once left.
    MAX_POOL: Final = 8

    def __init__(self, run_bytes: int) -> None:
        if run_bytes <= 0:
            raise ValueError(f"run_bytes must be positive, got {run_bytes}")
        self.run_bytes = run_bytes
        self._arena_size = 2 * max(run_bytes, MAX_SEND_SIZE)
        self._pool: list[bytearray] = []
        self._arena: bytearray | None = None
        self._at = 0
        self._run: AppendRequest | None = None

    def _free_arena(self) -> bytearray:
        pool = self._pool
        for k in range(len(pool)):
            # References: the list's and getrefcount's argument; a live view of it adds one.
            if sys.getrefcount(pool[k]) == 2:
                return pool[k]
        arena = bytearray(self._arena_size)
        if len(pool) < self.MAX_POOL:
            pool.append(arena)
        return arena

    def __call__(self, data: bytearray, start: int, end: int, max_length: int) -> int:
        if self._run is not None:
            return start  # the last run was not taken yet
        arena, at = self._arena, self._at
        if arena is None or len(arena) - at < MAX_SEND_SIZE:
            self._arena = None  # not a reference of its own while the pool is searched
            arena, at = self._free_arena(), 0
            self._arena, self._at = arena, 0
        room = len(arena) - at
        stop, count, term, gen, begin, end_lsn, commit, trunc = take_append_run(
            data, start, end, max_length, memoryview(arena)[at:], min(self.run_bytes, room)
        )
        if count:
            n = end_lsn - begin
            self._run = AppendRequest(
                term, Lsn(begin), Lsn(end_lsn), Lsn(commit), Lsn(trunc),
                memoryview(arena)[at : at + n], generation=gen, messages=count,
            )
            self._at = at + n
        return stop

    def release_idle_memory(self) -> None:
        """Forget every arena no run uses any more (``copy_receive_scan`` calls this when the
        connection waits idle, as it releases its receive buffer): an idle push connection
        then holds no arena; arenas still under a live run stay until it is written."""
        self._arena = None
        pool = self._pool
        for k in range(len(pool) - 1, -1, -1):
            if sys.getrefcount(pool[k]) == 2:  # the list's and the argument's: no view left
                del pool[k]

    def take(self) -> AppendRequest | None:
        """The run the last call took, if it took one (then it is forgotten here)."""
        run, self._run = self._run, None
        return run

    @property
    def pool_size(self) -> int:
        """Arenas kept (in use or free)."""
        return len(self._pool)
