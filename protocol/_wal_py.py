"""WAL kernels in pure Python: the reference twin of ``protocol/_wal_c.pyx``.

Same names, signatures and results (errors included) as the compiled module; the tests run
both on the same bytes (tests/protocol/test_native_wal.py). Which one the rest of pagestore
uses is decided once, by ``protocol._native`` (``PAGESTORE_PURE_PYTHON=1`` selects this one).

- ``crc32c(data, value=0)``: CRC-32C continuing from ``value`` (``crc32c(b, crc32c(a)) ==
  crc32c(a + b)``). This twin calls the ``crc32c`` package (a C extension pagestore already
  depends on): a pure-Python table runs at ~10 MB/s, too slow for even the test suite, and
  the package is an independent implementation for the differential tests. The tests also
  check both against a pure-Python bitwise definition.
- ``crc32c_kernel()``: which CRC kernel runs (``"sse4.2"``, ``"table"`` or, here,
  ``"crc32c-package/hardware"`` / ``"crc32c-package/software"``).
- ``scan_records(buf, i, n, base, seg_size)``: the safekeeper's record walk (see its
  docstring).
- ``RecordTracker(start_lsn, seg_size)``: the safekeeper's streaming record-boundary finder
  (contract: ``safekeeper/record_tracker.py``); its fast path is ``scan_records``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from protocol.lsn import Lsn
from protocol.wal.errors import InvalidWal

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "RecordTracker", "crc32c", "crc32c_kernel", "scan_records"]

IMPL: Final = "python"

# PostgreSQL 15 constants (protocol.wal.page / rmgr / record; this module stays a leaf so the
# compiled twin can mirror it exactly; tests/protocol/test_native_wal.py checks they agree).
XLOG_BLCKSZ: Final = 8192
SHORT_PHD: Final = 24
RECORD_HEADER: Final = 24
XLOG_PAGE_MAGIC: Final = 0xD110
XLP_FIRST_IS_CONTRECORD: Final = 0x0001
XLP_LONG_HEADER: Final = 0x0002
XLP_ALL_FLAGS: Final = 0x000F
XLOG_SWITCH: Final = 0x40
RM_XLOG_ID: Final = 0
XLP_FIRST_IS_OVERWRITE_CONTRECORD: Final = 0x0008
LONG_PHD: Final = 40
MAX_RECORD_LEN: Final = 0x3FFFFFFF
WAL_SEGMENT_SIZE: Final = 16 * 1024 * 1024
# CRC-32C over any message followed by its own CRC (little-endian) is this constant: checking
# header bytes [0, 24) (the stored xl_crc last) against it is the "computed == stored" check.
CRC_RESIDUE: Final = 0x48674BC7

_PAGE_HEADER = struct.Struct("<HHIQI")
_LONG_TAIL = struct.Struct("<QII")
_U32 = struct.Struct("<I")
_REC_HEAD = struct.Struct("<I12xBB")
# A continuation page's header may not have unknown bits nor the long-header flag.
_BAD_CONT_INFO = (~XLP_ALL_FLAGS | XLP_LONG_HEADER) & 0xFFFF
_PAGE_ROOM = XLOG_BLCKSZ - SHORT_PHD
# Records shorter than this make scan_records slice a bytes copy of the buffer.
_COPY_BELOW = 2048


_package_crc: Callable[[Buffer, int], int] | None = None


def _crc() -> Callable[[Buffer, int], int]:
    # The package's __init__ imports socket (protocol/ may not, at import): load it lazily.
    global _package_crc
    if _package_crc is None:
        from crc32c import crc32c as fast

        _package_crc = fast
    return _package_crc


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (the previous call's result)."""
    if not 0 <= value <= 0xFFFFFFFF:
        raise OverflowError(f"CRC value {value} out of range")
    return int(_crc()(data, value))


def crc32c_kernel() -> str:
    """Which CRC-32C kernel this twin runs."""
    import crc32c as package

    return "crc32c-package/" + ("hardware" if package.hardware_based else "software")


def _check_scan_args(buf_len: int, i: int, n: int, base: int, seg_size: int) -> None:
    if not 0 <= i <= n <= buf_len:
        raise ValueError(f"scan range [{i}, {n}) is not inside a buffer of {buf_len} bytes")
    if seg_size <= 0 or seg_size % XLOG_BLCKSZ:
        raise ValueError(f"segment size {seg_size} is not a positive multiple of {XLOG_BLCKSZ}")
    if base < 0 or base + n >= 1 << 64:
        raise ValueError(f"base LSN {base:#x} + {n} is not a 64-bit LSN")
    if (base + i) % 8:
        raise ValueError(f"record start {base + i:#x} is not MAXALIGNed")


def scan_records(buf: Buffer, i: int, n: int, base: int, seg_size: int) -> tuple[int, int, int]:
    """Walk complete records in ``buf[i:n]`` (``buf[k]`` is the WAL byte at LSN ``base + k``).

    ``i`` must be a MAXALIGNed record start that is not a page start. Consumes every record
    that lies wholly in ``buf[i:n]``, with its MAXALIGN padding, including records that
    continue over short page headers (each checked: magic, address, flags, continuation
    length); every record's CRC-32C is checked. It stops before anything else (a page start,
    a segment's long header, an XLOG_SWITCH, an incomplete record, anything suspicious),
    which the caller's state machine handles and reports.

    Returns ``(index, last_end, bad)``: ``index`` where the caller resumes; ``last_end`` the
    index just past the last complete record's padding (``-1`` if none; it may exceed ``n``
    when the padding is not in the buffer, and then ``index`` is that record's end);
    ``bad`` the index of the first record whose CRC is wrong (``-1`` if none; the walk stops
    there, and ``last_end`` covers the good records before it).
    """
    view = memoryview(buf).cast("B")
    _check_scan_args(len(view), i, n, base, seg_size)
    # Slicing bytes is cheaper than slicing a memoryview (two slices per record); a caller
    # that calls this per page (the tracker) makes one bytes copy per feed and passes that.
    data: bytes | memoryview = buf if type(buf) is bytes else view
    crc32 = _crc()
    unpack = _REC_HEAD.unpack_from
    unpack_page = _PAGE_HEADER.unpack_from
    last_end = -1
    while True:
        in_page = (base + i) % XLOG_BLCKSZ
        if not in_page:
            break  # a page header: the caller's
        page_end = i + XLOG_BLCKSZ - in_page
        stop = page_end if page_end < n else n
        # Records wholly on this page.
        while stop - i >= RECORD_HEADER:
            tot_len, info, rmid = unpack(data, i)
            end = i + tot_len
            if tot_len < RECORD_HEADER or end > stop:
                break
            if rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH:
                break
            body = i + RECORD_HEADER
            if crc32(data[i:body], crc32(data[body:end], 0)) != CRC_RESIDUE:
                return i, last_end, i
            # MAXALIGN: a record starts aligned, so its padding follows from its length.
            last_end = i + ((tot_len + 7) & ~7)
            if last_end > n:
                return end, last_end, -1  # the padding is not in this buffer
            i = last_end
        # A record that continues on the next pages, if it is all in the buffer.
        if page_end - i < RECORD_HEADER or n - i < RECORD_HEADER:
            break
        tot_len, info, rmid = unpack(data, i)
        end = i + tot_len
        if end <= page_end or end > n or (rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH):
            break
        body = i + RECORD_HEADER
        crc = crc32(data[body:page_end], 0)
        left = end - page_end
        p = page_end
        while left:
            piece = p + SHORT_PHD
            if piece > n or (base + p) % seg_size == 0:
                break
            magic, pinfo, _tli, pageaddr, rem_len = unpack_page(data, p)
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
            crc = crc32(data[piece:p], crc)
            left -= take
        if left:
            break
        if crc32(data[i:body], crc) != CRC_RESIDUE:
            return i, last_end, i
        last_end = ((base + p + 7) & ~7) - base
        if last_end > n:
            return p, last_end, -1
        i = last_end
    return i, last_end, -1


# -- RecordTracker -------------------------------------------------------------------------

# What the next byte is: part of a page header, of a record header, of a record body, or
# alignment / XLOG_SWITCH padding to skip.
_PAGE_HDR, _REC_HDR, _REC_BODY, _SKIP = range(4)


def _where(page_lsn: int) -> str:
    # Only built for an error: once per page it costed ~5% of tracking.
    return f"WAL page at {page_lsn >> 32:X}/{page_lsn & 0xFFFFFFFF:X}"


class RecordTracker:
    """Streaming record-boundary finder with CRC checks (the safekeeper's
    ``safekeeper.record_tracker``, whose docstring has the contract)."""

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
        if start_lsn % 8 or not 0 <= start_lsn < 1 << 64:
            raise ValueError(f"record boundary {start_lsn:#x} is not a MAXALIGNed LSN")
        if seg_size <= 0 or seg_size % XLOG_BLCKSZ or seg_size >= 1 << 32:
            raise ValueError(f"segment size {seg_size} is not a positive multiple of {XLOG_BLCKSZ}")
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

    def feed_many(
        self, chunks: Sequence[bytes | bytearray | memoryview]
    ) -> tuple[int, Lsn, InvalidWal | None]:
        """``feed`` each of ``chunks`` in order. Returns ``(fed, good_end, error)``: the chunks
        consumed without error, ``record_end`` before the chunk that failed (or after the
        last one), and that chunk's ``InvalidWal`` (None if none). (The compiled twin runs
        all of them in one stretch without the GIL.)"""
        fed = 0
        for chunk in chunks:
            good_end = self.record_end
            try:
                self.feed(chunk)
            except InvalidWal as exc:
                return fed, good_end, exc
            fed += 1
        return fed, self.record_end, None

    def feed(self, data: bytes | bytearray | memoryview) -> Lsn:
        """Consume ``data`` (the bytes at ``self.pos``); return the new ``record_end``."""
        view = memoryview(data).cast("B")
        crc = _crc()
        # What the fast path slices (two slices per record and one per page piece): a bytes
        # copy of the chunk when records are small (slicing bytes is cheaper than slicing a
        # memoryview, so the copy pays for itself), the view itself when they are large.
        # Decided once per feed: scan_records would otherwise copy at every page.
        flat: bytes | memoryview | None = data if type(data) is bytes else None
        i = 0
        n = len(view)
        while i < n:
            pos = self.pos
            page_left = XLOG_BLCKSZ - pos % XLOG_BLCKSZ
            state = self._state
            if state == _REC_BODY:
                take = min(self._body_left, n - i, page_left)
                self._crc = crc(view[i : i + take], self._crc)
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
        crc = _crc()(memoryview(rhdr)[:20], self._crc)
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
