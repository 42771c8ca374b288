"""Record boundaries in a stream of raw PostgreSQL WAL (page headers included).

The safekeeper reports ``flush_lsn`` on record boundaries, so it must know where each record
ends; it never looks inside a record beyond its 24-byte header. ``RecordTracker`` is fed the
bytes in LSN order, in pieces of any size, validates page headers and each record's CRC-32C,
and exposes ``record_end``: the end LSN of the last complete record (PostgreSQL's EndRecPtr:
MAXALIGNed; after an XLOG_SWITCH record, the next segment's start once its padding was fed).

It must start at a record boundary. Invalid WAL raises ``InvalidWal``; the restart scan
treats that as the end of WAL, the ingest path as the proposer's fault.
"""

from __future__ import annotations

import struct
from typing import NoReturn

import crc32c

from protocol.errors import RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn
from protocol.wal.page import (
    XLOG_PAGE_MAGIC,
    XLP_ALL_FLAGS,
    XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD,
    XLP_LONG_HEADER,
)
from protocol.wal.rmgr import XLOG_SWITCH, RmgrId

SHORT_PHD = 24
LONG_PHD = 40
RECORD_HEADER = 24
MAX_RECORD_LEN = 0x3FFFFFFF
RM_XLOG_ID = int(RmgrId.XLOG)  # a plain int for the per-record comparison

_PAGE_HEADER = struct.Struct("<HHIQI")
_LONG_TAIL = struct.Struct("<QII")
_U32 = struct.Struct("<I")
# xl_tot_len, then (after xl_xid and xl_prev) xl_info and xl_rmid.
_REC_HEAD = struct.Struct("<I12xBB")
# CRC-32C over any message followed by its own CRC (little-endian) is this constant, and
# only the right 4 bytes give it: checking the 20 header bytes plus the stored xl_crc
# against it is exactly the "computed == stored" check, one unpack cheaper.
_CRC_RESIDUE = 0x48674BC7

# A continuation page's header may not have unknown bits nor the long-header flag (the
# fast path leaves segment starts, where the long header belongs, to the state machine).
_BAD_CONT_INFO = (~XLP_ALL_FLAGS | XLP_LONG_HEADER) & 0xFFFF
# Record bytes a page holds after a short header.
_PAGE_ROOM = XLOG_BLCKSZ - SHORT_PHD
# Records shorter than this make the fast path slice a bytes copy of the chunk.
_COPY_BELOW = 2048

# What the next byte is: part of a page header, of a record header, of a record body, or
# alignment / XLOG_SWITCH padding to skip.
_PAGE_HDR, _REC_HDR, _REC_BODY, _SKIP = range(4)


def _where(page_lsn: int) -> str:
    # Only built for an error: once per page it costed ~5% of tracking.
    return f"WAL page at {page_lsn >> 32:X}/{page_lsn & 0xFFFFFFFF:X}"


class InvalidWal(RemoteProtocolError):
    """The bytes are not valid PostgreSQL 15 WAL at this position."""


class RecordTracker:
    """Streaming record-boundary finder with CRC checks; see the module docstring."""

    __slots__ = (
        "_after_page",
        "_body_left",
        "_crc",
        "_phdr",
        "_phdr_len",
        "_rhdr",
        "_skip_to",
        "_state",
        "_tot_len",
        "pos",
        "record_end",
        "seg_size",
    )

    def __init__(self, start_lsn: Lsn, seg_size: int = WAL_SEGMENT_SIZE) -> None:
        if start_lsn % 8:
            raise ValueError(f"record boundary {start_lsn:#x} is not MAXALIGNed")
        self.seg_size = seg_size
        self.pos = start_lsn
        self.record_end = start_lsn
        self._phdr = bytearray()
        self._phdr_len = 0
        self._rhdr = bytearray()
        self._tot_len = 0
        self._body_left = 0
        self._crc = 0
        self._skip_to = 0
        self._state = _REC_HDR
        self._after_page = _REC_HDR
        if start_lsn % XLOG_BLCKSZ == 0:
            self._enter_page_header()

    def _enter_page_header(self) -> None:
        self._after_page = self._state
        self._state = _PAGE_HDR
        self._phdr = bytearray()
        self._phdr_len = LONG_PHD if self.pos % self.seg_size == 0 else SHORT_PHD

    def feed(self, data: bytes | bytearray | memoryview) -> Lsn:
        """Consume ``data`` (the bytes at ``self.pos``); return the new ``record_end``."""
        view = memoryview(data).cast("B")
        # What the fast path slices (two slices per record and one per page piece): a bytes
        # copy of the chunk when records are small (slicing bytes is cheaper than slicing a
        # memoryview, so the copy pays for itself), the view itself when they are large.
        flat: bytes | memoryview | None = data if type(data) is bytes else None
        i = 0
        n = len(view)
        while i < n:
            pos = self.pos
            page_left = XLOG_BLCKSZ - pos % XLOG_BLCKSZ
            state = self._state
            if state == _REC_BODY:
                take = min(self._body_left, n - i, page_left)
                self._crc = crc32c.crc32c(view[i : i + take], self._crc)
                i += take
                self.pos = Lsn(pos + take)
                self._body_left -= take
                if not self._body_left:
                    self._finish_record()
                elif take == page_left:
                    self._enter_page_header()
            elif state == _PAGE_HDR:
                take = min(self._phdr_len - len(self._phdr), n - i)
                self._phdr += view[i : i + take]
                i += take
                self.pos = Lsn(pos + take)
                if len(self._phdr) == self._phdr_len:
                    self._check_page_header(Lsn(self.pos - self._phdr_len))
            elif state == _REC_HDR:
                if not self._rhdr:
                    if pos & 7:
                        pad = 8 - (pos & 7)
                        if pad > n - i:
                            self._skip_to = pos + pad
                            self._state = _SKIP
                            continue
                        i += pad
                        pos = self.pos = Lsn(pos + pad)
                        if pos % XLOG_BLCKSZ == 0:
                            self._enter_page_header()
                            continue
                        page_left -= pad
                    # Fast path: whole records on this page and in this buffer, in a tight
                    # loop (this is the safekeeper's hottest code).
                    if n - i >= RECORD_HEADER:
                        if flat is None:
                            (first_len,) = _U32.unpack_from(view, i)
                            flat = view.tobytes() if first_len < _COPY_BELOW else view
                        i, pos = self._fast_records(flat, i, n, pos)
                        if pos != self.pos:
                            self.pos = pos
                            if pos % XLOG_BLCKSZ == 0:
                                self._enter_page_header()
                            continue
                take = min(RECORD_HEADER - len(self._rhdr), n - i, page_left)
                self._rhdr += view[i : i + take]
                i += take
                self.pos = Lsn(pos + take)
                if len(self._rhdr) >= 4 and not self._tot_len:
                    (tot_len,) = _U32.unpack_from(self._rhdr, 0)
                    if tot_len < RECORD_HEADER or tot_len > MAX_RECORD_LEN:
                        raise InvalidWal(f"invalid record length {tot_len} at {pos:#x}")
                    self._tot_len = tot_len
                if len(self._rhdr) == RECORD_HEADER:
                    self._body_left = self._tot_len - RECORD_HEADER
                    self._crc = 0
                    self._state = _REC_BODY
                    if not self._body_left:
                        self._finish_record()
                        continue
                if take == page_left:
                    self._enter_page_header()
            else:  # _SKIP
                take = min(self._skip_to - pos, n - i)
                i += take
                self.pos = Lsn(pos + take)
                if self.pos == self._skip_to:
                    self._state = _REC_HDR
                    if self.pos % self.seg_size == 0:
                        # The end of an XLOG_SWITCH record's segment.
                        self.record_end = self.pos
                    if self.pos % XLOG_BLCKSZ == 0:
                        self._enter_page_header()
        return self.record_end

    def _fast_records(
        self, buf: bytes | memoryview, i: int, n: int, pos: int
    ) -> tuple[int, Lsn]:
        """Consume complete records that lie entirely in ``buf[i:n]``, each followed by its
        MAXALIGN padding, including records that continue over short page headers (each
        such header checked exactly as ``_check_page_header`` would: magic, address, flags,
        continuation length); stop before anything else (a page start, a segment's long
        header, XLOG_SWITCH, an incomplete record, anything suspicious) and leave it to the
        general state machine, which also produces the error for what is wrong. Returns the
        new (index, position); the caller handles a page start. ``pos`` is not on one."""
        # Per record: one unpack and two CRC calls, plus one unpack and one CRC call per page
        # it continues on. The stored CRC is checked through the CRC-32C residue (see
        # _CRC_RESIDUE) so it is never unpacked; positions are derived from the index.
        crc32 = crc32c.crc32c
        unpack = _REC_HEAD.unpack_from
        unpack_page = _PAGE_HEADER.unpack_from
        seg_size = self.seg_size
        base = pos - i
        last_end = -1
        while True:
            in_page = (base + i) % XLOG_BLCKSZ
            if not in_page:
                break  # a page header: the caller's
            page_end = i + XLOG_BLCKSZ - in_page
            stop = page_end if page_end < n else n
            # Records wholly on this page: the hottest loop of the safekeeper.
            while stop - i >= RECORD_HEADER:
                tot_len, info, rmid = unpack(buf, i)
                end = i + tot_len
                if tot_len < RECORD_HEADER or end > stop:
                    break
                if rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH:
                    break
                body = i + RECORD_HEADER
                if crc32(buf[i:body], crc32(buf[body:end])) != _CRC_RESIDUE:
                    self._fast_fail(base, last_end, i)
                # MAXALIGN: a record starts aligned, so its padding follows from its length.
                last_end = i + ((tot_len + 7) & ~7)
                if last_end > n:
                    # The padding is not in this buffer: let the slow path skip it.
                    self.record_end = Lsn(base + last_end)
                    return end, Lsn(base + end)
                i = last_end
            # A record that continues on the next pages, if it is all in the buffer.
            if page_end - i < RECORD_HEADER or n - i < RECORD_HEADER:
                break
            tot_len, info, rmid = unpack(buf, i)
            end = i + tot_len
            if end <= page_end or end > n or (rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH):
                break
            body = i + RECORD_HEADER
            crc = crc32(buf[body:page_end])
            left = end - page_end
            p = page_end
            while left:
                piece = p + SHORT_PHD
                if piece > n or (base + p) % seg_size == 0:
                    break
                magic, pinfo, _tli, pageaddr, rem_len = unpack_page(buf, p)
                if (
                    magic != XLOG_PAGE_MAGIC
                    or pageaddr != base + p
                    or pinfo & _BAD_CONT_INFO
                    or not pinfo & XLP_FIRST_IS_CONTRECORD
                    or rem_len != left
                ):
                    break
                take = left if left < _PAGE_ROOM else _PAGE_ROOM
                p = piece + take
                if p > n:
                    break
                crc = crc32(buf[piece:p], crc)
                left -= take
            if left:
                break
            if crc32(buf[i:body], crc) != _CRC_RESIDUE:
                self._fast_fail(base, last_end, i)
            last_end = ((base + p + 7) & ~7) - base
            if last_end > n:
                self.record_end = Lsn(base + last_end)
                return p, Lsn(base + p)
            i = last_end
        if last_end >= 0:
            self.record_end = Lsn(base + last_end)
        return i, Lsn(base + i)

    def _fast_fail(self, base: int, last_end: int, i: int) -> NoReturn:
        """A CRC mismatch in ``_fast_records``: publish the end of the records it verified
        before raising. The restart scan relies on it: there the WAL ends in a torn record
        (its header written, the rest zeros), and without this the records before it in the
        same read chunk would be lost although they were acknowledged."""
        if last_end >= 0:
            self.record_end = Lsn(base + last_end)
        raise InvalidWal(f"record CRC mismatch for the record at {base + i:#x}")

    def _check_page_header(self, page_lsn: Lsn) -> None:
        magic, info, _tli, pageaddr, rem_len = _PAGE_HEADER.unpack_from(self._phdr, 0)
        if magic != XLOG_PAGE_MAGIC:
            raise InvalidWal(f"bad page magic {magic:#06x} on {_where(page_lsn)}")
        if pageaddr != page_lsn:
            raise InvalidWal(f"page address {pageaddr:#x} on {_where(page_lsn)}")
        if info & ~XLP_ALL_FLAGS:
            raise InvalidWal(f"invalid page info bits {info:#x} on {_where(page_lsn)}")
        is_long = bool(info & XLP_LONG_HEADER)
        if is_long != (page_lsn % self.seg_size == 0):
            raise InvalidWal(f"long header flag {is_long} does not fit {_where(page_lsn)}")
        if is_long:
            _sysid, seg_size, blcksz = _LONG_TAIL.unpack_from(self._phdr, SHORT_PHD)
            if seg_size != self.seg_size or blcksz != XLOG_BLCKSZ:
                raise InvalidWal(
                    f"segment size {seg_size} / block size {blcksz} on {_where(page_lsn)}"
                )
        resume = self._after_page
        in_record = resume == _REC_BODY or (resume == _REC_HDR and bool(self._rhdr))
        if in_record and info & XLP_FIRST_IS_OVERWRITE_CONTRECORD:
            # PostgreSQL crashed with this record only partly flushed; its recovery kept the
            # bytes before this page and wrote an OVERWRITE_CONTRECORD record here instead of
            # the rest. Drop the unfinished record (it was never counted in record_end) and
            # read a new record header after this page header, as PostgreSQL's reader does.
            self._rhdr = bytearray()
            self._tot_len = 0
            self._body_left = 0
            self._crc = 0
            self._state = _REC_HDR
            return
        if in_record:
            left = self._tot_len - len(self._rhdr) if resume == _REC_HDR else self._body_left
            if not self._tot_len:
                # Only part of xl_tot_len was on the previous page: PostgreSQL never does that.
                raise InvalidWal(f"record length split across pages before {_where(page_lsn)}")
            if not info & XLP_FIRST_IS_CONTRECORD or rem_len != left:
                raise InvalidWal(
                    f"missing continuation ({rem_len} of {left} bytes) on {_where(page_lsn)}"
                )
            self._state = resume
        else:
            if info & XLP_FIRST_IS_CONTRECORD:
                raise InvalidWal(f"unexpected continuation record on {_where(page_lsn)}")
            self._state = _REC_HDR

    def _finish_record(self) -> None:
        rhdr = self._rhdr
        crc = crc32c.crc32c(memoryview(rhdr)[:20], self._crc)
        (stored,) = _U32.unpack_from(rhdr, 20)
        if crc != stored:
            raise InvalidWal(f"record CRC mismatch for the record ending at {self.pos:#x}")
        is_switch = rhdr[17] == RM_XLOG_ID and rhdr[16] & 0xF0 == XLOG_SWITCH
        self._rhdr = bytearray()
        self._tot_len = 0
        self._state = _REC_HDR
        if is_switch and self.pos % self.seg_size:
            # The rest of the segment is padding; the next record starts on the next segment.
            self._skip_to = (self.pos // self.seg_size + 1) * self.seg_size
            self._state = _SKIP
        else:
            self.record_end = Lsn((self.pos + 7) & ~7)
        if self.pos % XLOG_BLCKSZ == 0:
            self._enter_page_header()
