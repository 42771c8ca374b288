"""WAL page headers (PostgreSQL 15 ``XLogPageHeaderData`` / ``XLogLongPageHeaderData``).

Every 8 KiB WAL page starts with a 24-byte short header; the first page of each segment
carries the 40-byte long header instead (system identifier, segment size, page size).
``xlp_rem_len`` on a page flagged ``XLP_FIRST_IS_CONTRECORD`` counts the bytes of the record
begun on an earlier page that are still to come (all of them, not just this page's share).

Also here: ``record_end_lsn``, PostgreSQL's "end of record" position (EndRecPtr) computed
from a record's start and length alone, which is what page LSNs and Neon's keys use.
"""

from __future__ import annotations

import struct

import attrs

from protocol.errors import RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn, format_lsn, segment_file_name

XLOG_PAGE_MAGIC = 0xD110  # PostgreSQL 15; the value changes with every major release

XLP_FIRST_IS_CONTRECORD = 0x0001
XLP_LONG_HEADER = 0x0002
XLP_BKP_REMOVABLE = 0x0004
XLP_FIRST_IS_OVERWRITE_CONTRECORD = 0x0008
XLP_ALL_FLAGS = 0x000F

SIZE_OF_SHORT_PHD = 24
SIZE_OF_LONG_PHD = 40

# magic, info, tli, pageaddr, rem_len (4 padding bytes follow, not part of the struct)
SHORT_PHD = struct.Struct("<HHIQI")
# sysid, seg_size, xlog_blcksz at offset 24
LONG_PHD_TAIL = struct.Struct("<QII")


@attrs.frozen(slots=True)
class XLogPageHeader:
    """One decoded page header; ``sysid`` etc. are ``None`` on short headers."""

    magic: int
    info: int
    tli: int
    pageaddr: int
    rem_len: int
    sysid: int | None = None
    seg_size: int | None = None
    xlog_blcksz: int | None = None

    @property
    def is_long(self) -> bool:
        return bool(self.info & XLP_LONG_HEADER)

    @property
    def size(self) -> int:
        return SIZE_OF_LONG_PHD if self.info & XLP_LONG_HEADER else SIZE_OF_SHORT_PHD


def page_header_size(lsn: int, segment_size: int = WAL_SEGMENT_SIZE) -> int:
    """Size of the header of the page that starts at (or contains) ``lsn``."""
    return SIZE_OF_LONG_PHD if lsn % segment_size < XLOG_BLCKSZ else SIZE_OF_SHORT_PHD


def parse_page_header(buf: bytes | bytearray | memoryview, off: int = 0) -> XLogPageHeader:
    """Decode a page header without judging it (the reader validates against its position)."""
    if len(buf) - off < SIZE_OF_SHORT_PHD:
        raise RemoteProtocolError("truncated WAL page header")
    magic, info, tli, pageaddr, rem_len = SHORT_PHD.unpack_from(buf, off)
    if info & XLP_LONG_HEADER:
        if len(buf) - off < SIZE_OF_LONG_PHD:
            raise RemoteProtocolError("truncated WAL long page header")
        sysid, seg_size, blcksz = LONG_PHD_TAIL.unpack_from(buf, off + 24)
        return XLogPageHeader(magic, info, tli, pageaddr, rem_len, sysid, seg_size, blcksz)
    return XLogPageHeader(magic, info, tli, pageaddr, rem_len)


def page_header_error(
    hdr: XLogPageHeader,
    pageaddr: int,
    *,
    segment_size: int = WAL_SEGMENT_SIZE,
    timeline: int = 1,
) -> str | None:
    """PostgreSQL's ``XLogReaderValidatePageHeader`` checks for the page at ``pageaddr``.

    Returns pg_waldump's message for the first violated rule, or ``None`` if the header is
    acceptable. (The timeline-sequence check needs reader state and lives in the reader.)
    """
    return page_fields_error(
        hdr.magic, hdr.info, hdr.pageaddr, hdr.seg_size, hdr.xlog_blcksz, pageaddr,
        segment_size, timeline,
    )


def page_fields_error(
    magic: int,
    info: int,
    addr: int,
    seg_size: int | None,
    xlog_blcksz: int | None,
    pageaddr: int,
    segment_size: int,
    timeline: int,
) -> str | None:
    """``page_header_error`` from the header's fields (``seg_size`` and ``xlog_blcksz``:
    ``None`` on a short header), for readers that do not build an ``XLogPageHeader``.
    The message's location is formatted only when a rule is violated: a page that passes
    costs a few integer compares."""
    if magic != XLOG_PAGE_MAGIC:
        return f"invalid magic number {magic:04X} in {_where(pageaddr, segment_size, timeline)}"
    if info & ~XLP_ALL_FLAGS:
        return f"invalid info bits {info:04X} in {_where(pageaddr, segment_size, timeline)}"
    if info & XLP_LONG_HEADER:
        if seg_size != segment_size:
            return "WAL file is from different database system: incorrect segment size in page header"
        if xlog_blcksz != XLOG_BLCKSZ:
            return "WAL file is from different database system: incorrect XLOG_BLCKSZ in page header"
    elif pageaddr % segment_size == 0:
        # The first page of a segment must carry the long header.
        return f"invalid info bits {info:04X} in {_where(pageaddr, segment_size, timeline)}"
    if addr != pageaddr:
        return f"unexpected pageaddr {format_lsn(addr)} in {_where(pageaddr, segment_size, timeline)}"
    return None


def _where(pageaddr: int, segment_size: int, timeline: int) -> str:
    name = segment_file_name(pageaddr // segment_size, timeline, segment_size)
    return f"log segment {name}, offset {pageaddr % segment_size}"


def encode_page_header(
    pageaddr: int,
    *,
    info: int,
    rem_len: int = 0,
    tli: int = 1,
    sysid: int = 0,
    segment_size: int = WAL_SEGMENT_SIZE,
) -> bytes:
    """A page header for ``pageaddr``; long (with ``XLP_LONG_HEADER``) at a segment start."""
    if pageaddr % segment_size == 0:
        info |= XLP_LONG_HEADER
        return (
            SHORT_PHD.pack(XLOG_PAGE_MAGIC, info, tli, pageaddr, rem_len)
            + bytes(4)
            + LONG_PHD_TAIL.pack(sysid, segment_size, XLOG_BLCKSZ)
        )
    return SHORT_PHD.pack(XLOG_PAGE_MAGIC, info, tli, pageaddr, rem_len) + bytes(4)


def record_end_lsn(lsn: int, tot_len: int, segment_size: int = WAL_SEGMENT_SIZE) -> Lsn:
    """End of a record (PostgreSQL's EndRecPtr) that starts at ``lsn`` and is ``tot_len`` long.

    Page headers between the pieces are skipped; the result is MAXALIGNed, so a record that
    ends exactly at a page boundary ends at that boundary, not after the next page header.
    """
    page_rem = XLOG_BLCKSZ - lsn % XLOG_BLCKSZ
    if tot_len <= page_rem:
        return Lsn((lsn + tot_len + 7) & ~7)
    left = tot_len - page_rem
    pos = lsn + page_rem
    while True:
        hdr = SIZE_OF_LONG_PHD if pos % segment_size == 0 else SIZE_OF_SHORT_PHD
        room = XLOG_BLCKSZ - hdr
        if left <= room:
            return Lsn((pos + hdr + left + 7) & ~7)
        left -= room
        pos += XLOG_BLCKSZ
