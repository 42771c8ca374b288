"""Commit timestamps (``pg_commit_ts``, ``access/transam/commit_ts.c``) rebuilt from WAL.

With ``track_commit_timestamp = on`` every committed transaction (and its subtransactions) has a
10-byte entry in the commit_ts SLRU: the commit time (TimestampTz, int64 µs since 2000) and the
replication origin (RepOriginId, uint16), packed (``SizeOfCommitTimestampEntry``), 819 entries per
8 KiB page. PostgreSQL WAL-logs only ZEROPAGE and TRUNCATE for it: the entries come from the
Transaction COMMIT / COMMIT_PREPARED records (``xact_redo_commit`` ->
``TransactionTreeSetCommitTsData``): the time is the record's ``xact_time``, or the origin's
timestamp when the commit carries origin information, the origin id is the record header's.
Ingest stores the raw commit record on each commit_ts page its xids live on; this module
decodes it and sets the entries.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from pageserver.walredo.errors import RedoError
from protocol.wal.rmgr import (
    XACT_XINFO_HAS_DBINFO,
    XACT_XINFO_HAS_DROPPED_STATS,
    XACT_XINFO_HAS_GID,
    XACT_XINFO_HAS_INVALS,
    XACT_XINFO_HAS_ORIGIN,
    XACT_XINFO_HAS_RELFILENODES,
    XACT_XINFO_HAS_SUBXACTS,
    XACT_XINFO_HAS_TWOPHASE,
    XLOG_XACT_COMMIT,
    XLOG_XACT_COMMIT_PREPARED,
    XLOG_XACT_HAS_INFO,
    XLOG_XACT_OPMASK,
)

ENTRY_SIZE = 10  # SizeOfCommitTimestampEntry: TimestampTz + RepOriginId, no padding
COMMIT_TS_XACTS_PER_PAGE = 8192 // ENTRY_SIZE  # 819
_ENTRY = struct.Struct("<qH")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_ORIGIN = struct.Struct("<Qq")  # xl_xact_origin: origin_lsn, origin_timestamp


def commit_ts_page_of(xid: int) -> int:
    return xid // COMMIT_TS_XACTS_PER_PAGE


def parse_commit(info: int, xid: int, main: bytes, lsn: int) -> tuple[int, list[int]] | None:
    """(commit time, xids) of a COMMIT / COMMIT_PREPARED record, None for other Transaction
    records. ParseCommitRecord's order: xact_time, xinfo, dbinfo, subxacts, relfilenodes,
    dropped stats, invals, two-phase xid (+ gid), origin."""
    op = info & XLOG_XACT_OPMASK
    if op not in (XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED):
        return None
    try:
        (time,) = struct.unpack_from("<q", main, 0)
        pos = 8
        xinfo = 0
        if info & XLOG_XACT_HAS_INFO:
            (xinfo,) = _U32.unpack_from(main, pos)
            pos += 4
        if xinfo & XACT_XINFO_HAS_DBINFO:
            pos += 8
        subxacts: list[int] = []
        if xinfo & XACT_XINFO_HAS_SUBXACTS:
            (n,) = _I32.unpack_from(main, pos)
            if n < 0:
                raise struct.error
            subxacts = list(struct.unpack_from(f"<{n}I", main, pos + 4))
            pos += 4 + 4 * n
        for flag, width in ((XACT_XINFO_HAS_RELFILENODES, 12), (XACT_XINFO_HAS_DROPPED_STATS, 12),
                            (XACT_XINFO_HAS_INVALS, 16)):
            if xinfo & flag:
                (n,) = _I32.unpack_from(main, pos)
                if n < 0:
                    raise struct.error
                pos += 4 + width * n
        if xinfo & XACT_XINFO_HAS_TWOPHASE:
            (xid,) = _U32.unpack_from(main, pos)
            pos += 4
            if xinfo & XACT_XINFO_HAS_GID:
                end = main.index(b"\0", pos)
                pos = end + 1
        if xinfo & XACT_XINFO_HAS_ORIGIN:
            _origin_lsn, time = _ORIGIN.unpack_from(main, pos)
    except (struct.error, ValueError):
        raise RedoError("truncated transaction commit record", lsn=lsn, rmgr="Transaction") from None
    return time, [xid, *subxacts]


def set_entries(page: bytearray, pageno: int, xids: Iterable[int], time: int, origin: int) -> None:
    """TransactionTreeSetCommitTsData for the xids that live on commit_ts page ``pageno``."""
    for xid in xids:
        if xid // COMMIT_TS_XACTS_PER_PAGE == pageno:
            _ENTRY.pack_into(page, (xid % COMMIT_TS_XACTS_PER_PAGE) * ENTRY_SIZE, time, origin)


def get_entry(page: bytes | bytearray, xid: int) -> tuple[int, int]:
    time, origin = _ENTRY.unpack_from(page, (xid % COMMIT_TS_XACTS_PER_PAGE) * ENTRY_SIZE)
    return int(time), int(origin)


def _xid_precedes(a: int, b: int) -> bool:
    diff = (a - b) & 0xFFFF_FFFF
    return diff >= 0x8000_0000


def commit_ts_page_precedes(page1: int, page2: int) -> bool:
    """CommitTsPagePrecedes: page1 is before page2, modulo xid wraparound (whole page)."""
    xid1 = (page1 * COMMIT_TS_XACTS_PER_PAGE + 4) & 0xFFFF_FFFF  # FirstNormalTransactionId + 1
    xid2 = (page2 * COMMIT_TS_XACTS_PER_PAGE + 4) & 0xFFFF_FFFF
    return _xid_precedes(xid1, xid2) and _xid_precedes(xid1, (xid2 + COMMIT_TS_XACTS_PER_PAGE - 1) & 0xFFFF_FFFF)
