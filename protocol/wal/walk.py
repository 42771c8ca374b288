"""The least work any Python reader of WAL must do per record: the ingest's floor.

``walk_crc(wal, base_lsn, start_lsn, stop_lsn)`` walks the records of a contiguous piece of
PostgreSQL 15 WAL held in memory: it unpacks each record's header (``xl_tot_len``,
``xl_info``, ``xl_rmid``, ``xl_crc``), follows page boundaries (skipping each page header
after checking its ``xlp_magic`` and ``xlp_pageaddr``, reassembling records that span
pages, an XLOG_SWITCH jumping to the next segment) and checks every record's CRC-32C. Nothing
else: no ``xl_prev`` link, no body decoding, no record object. ``pagestore bench bulk-ingest``
times it over the captured WAL as the ``walk-crc-min`` row: whatever an ingest in Python
does per record on top of this is its own cost, and if this walk alone were near 2x
PostgreSQL's crash recovery, no Python ingest could meet issue 7's goal.

It is not the production decoder (``reader.WalStreamDecoder``); tests/protocol/test_wal_walk.py
checks that it finds the same records, the same end and a corrupted CRC, so the floor
measures real work.
"""

from __future__ import annotations

import struct

import attrs

from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ
from protocol.wal import crc as _crcmod
from protocol.wal.page import XLOG_PAGE_MAGIC, XLP_FIRST_IS_CONTRECORD, XLP_LONG_HEADER
from protocol.wal.record import MAX_RECORD_LENGTH, SIZE_OF_XLOG_RECORD
from protocol.wal.rmgr import XLOG_SWITCH

__all__ = ["WalkResult", "walk_crc"]

_PAGE_MASK = XLOG_BLCKSZ - 1
# xl_tot_len, xl_info, xl_rmid, xl_crc (xl_xid and xl_prev skipped)
_HDR = struct.Struct("<I12xBB2xI")
# xlp_magic, xlp_info, xlp_tli (skipped), xlp_pageaddr, xlp_rem_len
_PAGE = struct.Struct("<HH4xQI")
_SHORT, _LONG = 24, 40


@attrs.frozen(slots=True)
class WalkResult:
    """``records`` walked; ``end_lsn`` where the last one ends (the next would start);
    ``error`` why the walk stopped early (``None``: it reached ``stop_lsn`` or the input's end)."""

    records: int
    end_lsn: int
    error: str | None


def walk_crc(
    wal: bytes,
    base_lsn: int,
    start_lsn: int,
    stop_lsn: int | None = None,
    *,
    segment_size: int = WAL_SEGMENT_SIZE,
) -> WalkResult:
    """Walk the records of ``wal`` (bytes from ``base_lsn`` on, which must be at or before
    ``start_lsn``'s page start) from the record at ``start_lsn`` until a record starts at or
    past ``stop_lsn`` (default: the input's end), the input ends, or a check fails."""
    if base_lsn > start_lsn:
        raise ValueError("the WAL must start at or before the start record")
    _crcmod.crc32c(b"")  # bind the C function to the module attribute
    crc32c = _crcmod.crc32c
    unpack_hdr = _HDR.unpack_from
    n = len(wal)
    limit = base_lsn + n
    stop = limit if stop_lsn is None else min(stop_lsn, limit)
    pos = start_lsn
    count = 0
    if pos & _PAGE_MASK and base_lsn <= pos & ~_PAGE_MASK:
        # starting mid-page with that page's header at hand: check it once
        err = _page_error(wal, base_lsn, pos & ~_PAGE_MASK, n, segment_size)
        if err:
            return WalkResult(0, start_lsn, None if err == "short" else err)
    while pos < stop:
        if not pos & _PAGE_MASK:
            err = _page_error(wal, base_lsn, pos, n, segment_size)
            if err:
                return _result(count, pos, None if err == "short" else err, segment_size)
            pos += _LONG if not pos % segment_size else _SHORT
            continue
        # the records that start and end on this page: one tight loop
        o = pos - base_lsn
        page_end = (pos | _PAGE_MASK) + 1 - base_lsn
        # (below o_stop a whole record header is on this page and in the input)
        o_stop = min(page_end - SIZE_OF_XLOG_RECORD + 1, stop - base_lsn, n - SIZE_OF_XLOG_RECORD + 1)
        while o < o_stop:
            tot, info, rmid, crc = unpack_hdr(wal, o)
            e = o + tot
            if e > page_end or tot < SIZE_OF_XLOG_RECORD:
                break
            if e > n:
                return _result(count, base_lsn + o, None, segment_size)
            if crc32c(wal[o : o + 20], crc32c(wal[o + SIZE_OF_XLOG_RECORD : e])) != crc:
                return _result(count, base_lsn + o, f"bad CRC in record at {base_lsn + o:X}", segment_size)
            count += 1
            if rmid == 0 and info & 0xF0 == XLOG_SWITCH:
                o = ((base_lsn + o) // segment_size + 1) * segment_size - base_lsn
                break
            o = (e + 7) & ~7
        pos = base_lsn + o
        if pos >= stop or not pos & _PAGE_MASK or o >= page_end:
            continue
        # a record header that does not fit the page or the input (only xl_tot_len is sure
        # to be on this page), or a record that goes on on the next page(s)
        if page_end > n:
            return _result(count, pos, None, segment_size)
        tot = int.from_bytes(wal[o : o + 4], "little")
        if tot < SIZE_OF_XLOG_RECORD:
            return _result(count, pos, f"invalid record length {tot} at {pos:X}", segment_size)
        if tot > MAX_RECORD_LENGTH:
            return _result(count, pos, f"record length {tot} at {pos:X} too long", segment_size)
        got = page_end - o
        parts = [wal[o:page_end]]
        at = page_end + base_lsn
        while got < tot:
            err = _page_error(wal, base_lsn, at, n, segment_size)
            if err:
                return _result(count, pos, None if err == "short" else err, segment_size)
            po = at - base_lsn
            hsize = _LONG if not at % segment_size else _SHORT
            _magic, pinfo, _addr, rem = _PAGE.unpack_from(wal, po)
            if not pinfo & XLP_FIRST_IS_CONTRECORD or rem != tot - got:
                return _result(count, pos, f"bad contrecord at {at:X}", segment_size)
            piece = min(tot - got, XLOG_BLCKSZ - hsize)
            if po + hsize + piece > n:
                return _result(count, pos, None, segment_size)
            parts.append(wal[po + hsize : po + hsize + piece])
            got += piece
            at += hsize + piece
        raw = b"".join(parts)
        _tot, info, rmid, crc = unpack_hdr(raw)
        if crc32c(raw[:20], crc32c(raw[SIZE_OF_XLOG_RECORD:])) != crc:
            return _result(count, pos, f"bad CRC in record at {pos:X}", segment_size)
        count += 1
        if rmid == 0 and info & 0xF0 == XLOG_SWITCH:
            pos = (pos // segment_size + 1) * segment_size
        else:
            pos = (at + 7) & ~7
    return _result(count, pos, None, segment_size)


def _result(count: int, pos: int, error: str | None, segment_size: int) -> WalkResult:
    """``end_lsn`` is where the last record ended: right after a page header (no record
    ends there: a continuation has at least one byte) that is the page's start."""
    head = pos & _PAGE_MASK
    if count and head == (_LONG if not (pos - head) % segment_size else _SHORT):
        pos -= head
    return WalkResult(count, pos, error)


def _page_error(wal: bytes, base_lsn: int, page: int, n: int, segment_size: int) -> str:
    """'' if the page header at ``page`` is there and names this page, 'short' if the input
    ends before it, else what is wrong."""
    o = page - base_lsn
    hsize = _LONG if not page % segment_size else _SHORT
    if o + hsize > n:
        return "short"
    magic, info, addr, _rem = _PAGE.unpack_from(wal, o)
    if magic != XLOG_PAGE_MAGIC or addr != page or bool(info & XLP_LONG_HEADER) != (hsize == _LONG):
        return f"invalid page header at {page:X}"
    return ""
