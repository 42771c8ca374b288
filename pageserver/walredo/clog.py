"""Transaction status (CLOG, ``pg_xact``) pages: 2 bits per xid, no page header.

Commit and abort records set the status of the top-level xid and of every subtransaction
they list; a page only takes the xids that live on it. Raw Transaction records are parsed
here (``parse_xact_xids``), and pagestore's own ``ClogSetCommitted``/``ClogSetAborted``
values carry the xids already extracted by ingest.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from pageserver.walredo.bufpage import BLCKSZ
from pageserver.walredo.errors import RedoError
from protocol.wal.rmgr import (
    XACT_XINFO_HAS_DBINFO,
    XACT_XINFO_HAS_DROPPED_STATS,
    XACT_XINFO_HAS_INVALS,
    XACT_XINFO_HAS_RELFILENODES,
    XACT_XINFO_HAS_SUBXACTS,
    XACT_XINFO_HAS_TWOPHASE,
    XLOG_XACT_ABORT,
    XLOG_XACT_ABORT_PREPARED,
    XLOG_XACT_COMMIT,
    XLOG_XACT_COMMIT_PREPARED,
    XLOG_XACT_HAS_INFO,
    XLOG_XACT_OPMASK,
)

CLOG_BITS_PER_XACT = 2
CLOG_XACTS_PER_BYTE = 4
CLOG_XACTS_PER_PAGE = BLCKSZ * CLOG_XACTS_PER_BYTE
SLRU_PAGES_PER_SEGMENT = 32

TRANSACTION_STATUS_IN_PROGRESS = 0x00
TRANSACTION_STATUS_COMMITTED = 0x01
TRANSACTION_STATUS_ABORTED = 0x02
TRANSACTION_STATUS_SUB_COMMITTED = 0x03

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")


def clog_page_of(xid: int) -> int:
    return xid // CLOG_XACTS_PER_PAGE


def clog_set_status(page: bytearray, xid: int, status: int) -> None:
    byte = (xid % CLOG_XACTS_PER_PAGE) // CLOG_XACTS_PER_BYTE
    shift = (xid % CLOG_XACTS_PER_BYTE) * CLOG_BITS_PER_XACT
    page[byte] = (page[byte] & ~(0x03 << shift) & 0xFF) | (status << shift)


def clog_get_status(page: bytes | bytearray, xid: int) -> int:
    byte = (xid % CLOG_XACTS_PER_PAGE) // CLOG_XACTS_PER_BYTE
    shift = (xid % CLOG_XACTS_PER_BYTE) * CLOG_BITS_PER_XACT
    return (page[byte] >> shift) & 0x03


def clog_apply(page: bytearray, pageno: int, xids: Iterable[int], status: int) -> None:
    """Set ``status`` for the xids that live on CLOG page ``pageno``."""
    for xid in xids:
        if xid // CLOG_XACTS_PER_PAGE == pageno:
            clog_set_status(page, xid, status)


def parse_xact_xids(info: int, xid: int, main: bytes, lsn: int) -> tuple[int, list[int]] | None:
    """(status, xids) a commit/abort record decides, or None for other Transaction records.

    Follows ParseCommitRecord/ParseAbortRecord: after ``xact_time``, ``xinfo`` (if HAS_INFO)
    announces dbinfo, subxacts, relfilenodes, dropped stats, invals (commit only) and the
    two-phase xid, in that order.
    """
    op = info & XLOG_XACT_OPMASK
    if op in (XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED):
        status = TRANSACTION_STATUS_COMMITTED
        is_commit = True
    elif op in (XLOG_XACT_ABORT, XLOG_XACT_ABORT_PREPARED):
        status = TRANSACTION_STATUS_ABORTED
        is_commit = False
    else:
        return None
    try:
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
            pos += 4
            subxacts = list(struct.unpack_from(f"<{n}I", main, pos))
            pos += 4 * n
        if xinfo & XACT_XINFO_HAS_RELFILENODES:
            (n,) = _I32.unpack_from(main, pos)
            pos += 4 + 12 * n
        if xinfo & XACT_XINFO_HAS_DROPPED_STATS:
            (n,) = _I32.unpack_from(main, pos)
            pos += 4 + 12 * n
        if is_commit and xinfo & XACT_XINFO_HAS_INVALS:
            (n,) = _I32.unpack_from(main, pos)
            pos += 4 + 16 * n
        if xinfo & XACT_XINFO_HAS_TWOPHASE:
            (xid,) = _U32.unpack_from(main, pos)
    except struct.error:
        raise RedoError("truncated transaction commit/abort record", lsn=lsn, rmgr="Transaction") from None
    return status, [*subxacts, xid]
