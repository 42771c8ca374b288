"""Record boundaries in a stream of raw PostgreSQL WAL (page headers included).

The safekeeper reports ``flush_lsn`` on record boundaries, so it must know where each record
ends; it never looks inside a record beyond its 24-byte header. ``RecordTracker`` is fed the
bytes in LSN order, in pieces of any size, validates page headers and each record's CRC-32C,
and exposes ``record_end``: the end LSN of the last complete record (PostgreSQL's EndRecPtr:
MAXALIGNed; after an XLOG_SWITCH record, the next segment's start once its padding was fed).
``pos`` is the LSN of the next byte to feed; ``seg_size`` the WAL segment size.

It must start at a record boundary. Invalid WAL raises ``InvalidWal``; the restart scan
treats that as the end of WAL, the ingest path as the proposer's fault. On a bad record CRC,
``record_end`` first moves over the good records before it in the same ``feed``: the restart
scan relies on it (there the WAL ends in a torn record, its header written and the rest
zeros, and the records before it in the same read chunk were acknowledged).

The tracker is a WAL kernel: the compiled ``protocol/_wal_c.pyx`` or its pure-Python twin
``protocol/_wal_py.py`` (the reference), as ``protocol._native`` selects.
"""

from __future__ import annotations

from protocol.wal.errors import InvalidWal
from protocol.wal.kernels import RecordTracker

__all__ = ["InvalidWal", "RecordTracker"]
