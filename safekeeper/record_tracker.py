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

from protocol.errors import RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn
from protocol.wal.kernels import crc32c, scan_records
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
        i = 0
        n = len(view)
        while i < n:
            pos = self.pos
            page_left = XLOG_BLCKSZ - pos % XLOG_BLCKSZ
            state = self._state
            if state == _REC_BODY:
                take = min(self._body_left, n - i, page_left)
                self._crc = crc32c(view[i : i + take], self._crc)
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
                        i, pos = self._fast_records(view, i, n, pos)
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
        self, buf: memoryview, i: int, n: int, pos: int
    ) -> tuple[int, Lsn]:
        """Consume complete records that lie entirely in ``buf[i:n]`` with the WAL kernel
        (``protocol.wal.kernels.scan_records``: records on this page and records that continue
        over short page headers, CRCs checked); it stops before anything else (a page start, a
        segment's long header, XLOG_SWITCH, an incomplete record, anything suspicious) and
        leaves it to the general state machine, which also produces the error for what is
        wrong. Returns the new (index, position); the caller handles a page start. ``pos`` is
        not on one.

        On a CRC mismatch the end of the records verified before it is published before
        raising. The restart scan relies on it: there the WAL ends in a torn record (its
        header written, the rest zeros), and without this the records before it in the same
        read chunk would be lost although they were acknowledged."""
        base = pos - i
        i, last_end, bad = scan_records(buf, i, n, base, self.seg_size)
        if last_end >= 0:
            self.record_end = Lsn(base + last_end)
        if bad >= 0:
            raise InvalidWal(f"record CRC mismatch for the record at {base + bad:#x}")
        return i, Lsn(base + i)

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
        crc = crc32c(memoryview(rhdr)[:20], self._crc)
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
