"""A sans-IO PostgreSQL 15 WAL stream decoder.

``WalStreamDecoder(start_lsn)`` takes bytes with ``feed(data)`` (contiguous, starting at
``data_start``, which defaults to ``start_lsn``) and hands out records with ``next_record()``,
which returns a ``DecodedRecord``, ``NEED_DATA`` or an ``EndOfWal``; ``decode_into(list)``
appends every record decodable so far in one call (the same records, for less CPU: the WAL
receiver's batch path). Records are reassembled across pages and segments, including a
24-byte record header that is itself split by a page boundary. Every page header crossed is
validated.

Where reading starts:

- ``start_lsn`` on a page boundary: like pg_waldump's ``XLogFindNextRecord``, skip the
  continuation of a record begun on an earlier page (which may cover whole pages) and start
  at the first record that begins on or after it.
- ``start_lsn`` inside a page: a record begins exactly there (a replication start point, a
  stored ``end_lsn``). If ``data_start`` is the page start, that page's header is checked too.

The end of valid WAL is not an exception: PostgreSQL recognises it by a record that fails a
check (``xl_tot_len`` of zero or < 24, an invalid resource manager, a wrong ``xl_prev``, a bad
CRC, an undecodable body), a bad page header (magic, info bits, ``xlp_pageaddr``), or a
continuation page without ``XLP_FIRST_IS_CONTRECORD`` or with the wrong ``xlp_rem_len``.
``next_record`` then returns ``EndOfWal``: ``lsn`` is where valid WAL ends (the ``end_lsn`` of
the last good record), ``error_lsn`` and ``reason`` say what failed, in pg_waldump's words.
After that the decoder stays ended. ``finish()`` says "no more input": it returns the
``EndOfWal`` for a stream that stops here.

The first record after a start (or after ``prev_lsn=None``) is checked like PostgreSQL's
random access: its ``xl_prev`` must be below its own LSN. From then on ``xl_prev`` must equal
the previous record's start exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Final

import attrs

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn, format_lsn, segment_file_name
from protocol.wal import crc as _crcmod
from protocol.wal.page import (
    LONG_PHD_TAIL,
    SHORT_PHD,
    SIZE_OF_LONG_PHD,
    SIZE_OF_SHORT_PHD,
    XLOG_PAGE_MAGIC,
    XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD,
    XLP_LONG_HEADER,
    XLogPageHeader,
    page_fields_error,
)
from protocol.wal.record import (
    _RNODE_CACHE,
    _SIMPLE_HEADERS,
    _SIMPLE_NOT,
    _SIMPLE_PAYLOAD_AT,
    BKPBLOCK_FORK_MASK,
    BKPBLOCK_HAS_DATA,
    MAX_RECORD_LENGTH,
    SIZE_OF_XLOG_RECORD,
    XLOG_RECORD_HEADER,
    XLR_BLOCK_ID_DATA_SHORT,
    BlockRef,
    DecodedRecord,
    RelFileNode,
    _rnode,
    decode_body,
    record_crc,
)
from protocol.wal.rmgr import RM_MAX_BUILTIN_ID, XLOG_SWITCH, RmgrId, rmgr_id_is_valid

__all__ = ["NEED_DATA", "SIMPLE_HEADERS", "SIMPLE_PAYLOAD_AT", "SIMPLE_RECORD", "EndOfWal", "NeedData", "WalStreamDecoder"]

_PAGE_MASK = XLOG_BLCKSZ - 1
_U32 = struct.Struct("<I")
_RM_XLOG = int(RmgrId.XLOG)  # an enum member lookup per record costs more than the compare
# Records are built from trusted ints: going around the ``Lsn`` NewType's call (a Python-level
# function call per field) saves about 0.2 us per record.
_new_record: Callable[..., DecodedRecord] = DecodedRecord
_new_block: Callable[..., BlockRef] = BlockRef
# The XLogRecord header and the fragment headers of the commonest layout (see decode_body),
# unpacked together.
_SIMPLE_RECORD = struct.Struct(XLOG_RECORD_HEADER.format + _SIMPLE_HEADERS.format[1:])
# For readers with their own in-page loop (``in_page_cursor``; the ingest's fused path): that
# unpack gives xl_tot_len, xl_xid, xl_prev, xl_info, xl_rmid, xl_crc, then block id 0's
# id, fork_flags, data_length, spc, db, rel, blkno, then the main data's id and length; the
# block data starts at SIMPLE_PAYLOAD_AT.
SIMPLE_RECORD: Final = _SIMPLE_RECORD
SIMPLE_HEADERS: Final = _SIMPLE_HEADERS  # that tail alone
SIMPLE_PAYLOAD_AT: Final = _SIMPLE_PAYLOAD_AT


class NeedData:
    """Sentinel type: feed more bytes, then call ``next_record`` again."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


@attrs.frozen(slots=True)
class EndOfWal:
    """Where valid WAL ends, and why.

    ``lsn``: the end of the last valid record (where the next one would begin).
    ``error_lsn``: the position PostgreSQL's message names. ``reason``: that message.
    ``last_record_lsn``: start of the last valid record (pg_waldump's "error in WAL record
    at X"), ``None`` if none was read. ``truncated``: the input simply stopped (``finish``).
    """

    lsn: Lsn
    error_lsn: Lsn
    reason: str
    last_record_lsn: Lsn | None
    truncated: bool = False


@attrs.define(slots=True)
class _Partial:
    """A record whose pieces are still being collected from later pages."""

    lsn: int
    total: int
    parts: list[bytes]
    got: int
    header_checked: bool


class WalStreamDecoder:
    """Decode records from a contiguous WAL byte stream (see the module docstring)."""

    def __init__(
        self,
        start_lsn: int,
        *,
        data_start: int | None = None,
        prev_lsn: int | None = None,
        segment_size: int = WAL_SEGMENT_SIZE,
        timeline: int = 1,
    ) -> None:
        if start_lsn & 7:
            raise LocalProtocolError(f"WAL start {format_lsn(start_lsn)} is not MAXALIGNed")
        if data_start is None:
            data_start = start_lsn
        if data_start > start_lsn:
            raise LocalProtocolError("data_start is after start_lsn")
        page = start_lsn & ~_PAGE_MASK
        self._segment_size = segment_size
        self._timeline = timeline
        # Bytes before the page holding start_lsn are never looked at.
        self._drop_until = max(data_start, page)
        self._fed: int = data_start  # LSN just past the last byte fed
        # The unread input is immutable ``bytes`` so that a record is one slice (one copy);
        # fed chunks wait in ``_pending`` and are joined onto the unread rest by
        # ``next_record``, so feeding many small chunks stays linear.
        self._buf = b""
        self._pending: list[bytes] = []
        self._buf_lsn: int = self._drop_until
        # When starting mid-page with that page's header at hand, check it first.
        self._check_page_at: int | None = (
            page if start_lsn != page and data_start <= page else None
        )
        self._find_first = start_lsn == page
        self._pos: int = page if self._check_page_at is not None else start_lsn
        self._start_lsn = start_lsn
        self._prev: int | None = prev_lsn
        self._partial: _Partial | None = None
        self._last_lsn: int | None = None
        self._last_end: int = start_lsn
        self._latest_page: int = 0
        self._latest_tli: int = 0
        self._ended: EndOfWal | None = None
        # what crossing_record last gave: (end, lsn, next page, its timeline, its sysid)
        self._crossing: tuple[int, int, int, int, int | None] | None = None
        self.system_identifier: int | None = None

    # -- input ---------------------------------------------------------------------------

    @property
    def fed_lsn(self) -> Lsn:
        """LSN of the next byte ``feed`` expects."""
        return Lsn(self._fed)

    @property
    def position(self) -> Lsn:
        """Where the next record is expected (after the last decoded record)."""
        return Lsn(self._last_end)

    @property
    def last_record_start(self) -> Lsn | None:
        """Where the last decoded record (the one ending at ``position``) starts, if any."""
        return None if self._last_lsn is None else Lsn(self._last_lsn)

    @property
    def ended(self) -> EndOfWal | None:
        return self._ended

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        start = self._fed
        self._fed = start + n
        skip = self._drop_until - start
        if skip > 0:
            if skip >= n:
                return
            data = memoryview(data)[skip:]
            start += skip
        if not self._buf and not self._pending:
            self._buf_lsn = start
        # a copy unless already bytes: the caller may reuse its buffer
        self._pending.append(data if isinstance(data, bytes) else bytes(data))

    def _merge(self) -> None:
        """Join the pending chunks onto what is still unread (bytes before ``_pos`` are never
        looked at again)."""
        buf = self._buf
        drop = min(self._pos - self._buf_lsn, len(buf))
        if drop > 0:
            buf = buf[drop:]
            self._buf_lsn += drop
        parts = self._pending
        if buf:
            parts.insert(0, buf)
        self._buf = parts[0] if len(parts) == 1 else b"".join(parts)
        self._pending = []

    # -- output --------------------------------------------------------------------------

    def records(self) -> Iterator[DecodedRecord]:
        """Every record decodable from the bytes fed so far; stops at NEED_DATA or the end."""
        while True:
            item = self.next_record()
            if not isinstance(item, DecodedRecord):
                return
            yield item

    def decode_into(self, out: list[DecodedRecord]) -> NeedData | EndOfWal:
        """Append every record decodable from the bytes fed so far to ``out``; return what
        stopped it (``NEED_DATA`` or the ``EndOfWal``). The same records as calling
        ``next_record`` until it stops, for less CPU: records that start and end inside one
        page run through one loop over local variables, and the commonest layout (one block
        reference without image, then a short main data: heap and btree inserts) is parsed
        with its header in one ``struct`` unpack. Anything else, or anything that fails a
        check, goes to ``next_record``, which checks it again and reports."""
        if self._ended is not None:
            return self._ended
        if self._pending:
            self._merge()
        append = out.append
        crc32c = _crcmod.crc32c
        unpack_header = XLOG_RECORD_HEADER.unpack_from
        unpack_simple = _SIMPLE_RECORD.unpack_from
        new_record = _new_record
        new_block = _new_block
        rnode: RelFileNode | None = None  # the last simple block's relation (a bulk load: one)
        last_spc = last_db = last_rel = -1
        while True:
            if self._partial is None and self._check_page_at is None and self._ended is None:
                buf = self._buf
                base = self._buf_lsn
                nbuf = len(buf)
                pos = self._pos
                prev = self._prev
                start = pos
                while True:
                    page_rem = XLOG_BLCKSZ - (pos & _PAGE_MASK)
                    o = pos - base
                    avail = nbuf - o
                    # A page header next, a record header split by the page end, too few
                    # bytes: the general path decides.
                    if page_rem == XLOG_BLCKSZ or page_rem < SIZE_OF_XLOG_RECORD:
                        break
                    if avail >= _SIMPLE_PAYLOAD_AT:
                        (
                            tot_len, xid, xprev, info, rmid, crc,
                            block_id, fork_flags, data_len, spc, db, rel, blkno, main_id, main_len,
                        ) = unpack_simple(buf, o)
                    elif avail >= SIZE_OF_XLOG_RECORD:
                        tot_len, xid, xprev, info, rmid, crc = unpack_header(buf, o)
                        block_id = -1
                    else:
                        break
                    # Only the plainest record: every failed test (a wrong xl_prev, an XLOG
                    # record, a record past this page or the input...) goes to next_record.
                    if (
                        xprev != prev
                        or not SIZE_OF_XLOG_RECORD <= tot_len <= page_rem
                        or rmid > RM_MAX_BUILTIN_ID
                        or rmid == _RM_XLOG
                        or avail < tot_len
                    ):
                        break
                    raw = buf[o : o + tot_len]
                    if crc32c(raw[:20], crc32c(raw[SIZE_OF_XLOG_RECORD:])) != crc:
                        break
                    # decode_body's single-block fast path (the same tests, the same values)
                    if (
                        block_id == 0
                        and main_id == XLR_BLOCK_ID_DATA_SHORT
                        and not fork_flags & _SIMPLE_NOT
                        and _SIMPLE_PAYLOAD_AT + data_len + main_len == tot_len
                        and (data_len != 0) == (fork_flags & BKPBLOCK_HAS_DATA != 0)
                    ):
                        if rel != last_rel or db != last_db or spc != last_spc:
                            last_spc, last_db, last_rel = spc, db, rel
                            rnode_key = (spc, db, rel)
                            rnode = _RNODE_CACHE.get(rnode_key)
                            if rnode is None:
                                rnode = _rnode(rnode_key)
                        split = _SIMPLE_PAYLOAD_AT + data_len
                        blocks: tuple[BlockRef, ...] = (
                            new_block(
                                0, rnode, fork_flags & BKPBLOCK_FORK_MASK, blkno, fork_flags,
                                0, 0, 0, 0, None, raw[_SIMPLE_PAYLOAD_AT:split],
                            ),
                        )
                        main_data = raw[split:]
                        origin = top_xid = None
                    else:
                        try:
                            blocks, main_data, origin, top_xid = decode_body(raw, pos)
                        except RemoteProtocolError:
                            break
                    end = (pos + tot_len + 7) & ~7
                    append(
                        new_record(
                            pos, end, tot_len, xid, xprev, info, rmid, crc, blocks, main_data,
                            origin, top_xid, raw,
                        )
                    )
                    prev = pos
                    pos = end
                if pos != start:
                    self._pos = self._last_end = pos
                    self._prev = self._last_lsn = prev
            item = self.next_record()
            if not isinstance(item, DecodedRecord):
                return item
            append(item)

    def in_page_cursor(self) -> tuple[bytes, int, int, int | None] | None:
        """For a caller that walks the records inside a page itself (the ingest's fused path,
        ``WalIngest.ingest_decoder``): ``(buf, buf_lsn, pos, prev)`` -- the input (``buf[0]``
        is at LSN ``buf_lsn``), where the next record starts and the start of the record
        before it (its ``xl_prev`` must equal ``prev``; ``None``: unknown, so leave the record
        to ``next_record``) -- or ``None`` when the next record is not simply at ``pos`` (a
        page to check first, a record being joined across pages, the end of WAL): then
        ``next_record`` must go next. The caller may take complete records that start and
        end on ``pos``'s page (never a page header) after checking them as ``decode_into``
        does (``xl_prev``, length, resource manager, CRC), then report with
        ``advance_in_page``."""
        if self._pending:
            self._merge()
        if self._partial is not None or self._check_page_at is not None or self._ended is not None:
            return None
        return self._buf, self._buf_lsn, self._pos, self._prev

    def advance_in_page(self, pos: int, prev: int) -> None:
        """The caller of ``in_page_cursor`` took the records up to ``pos``; the last one
        started at ``prev``."""
        self._pos = self._last_end = pos
        self._prev = self._last_lsn = prev

    def walk_state(self) -> tuple[int, int, int] | None:
        """For the caller of ``in_page_cursor`` that walks across pages itself (the ingest
        kernel's ``fused_walk``): ``(segment size, latest page header read, its timeline)``,
        or ``None`` when only ``next_record`` may go next (the first record is still to be
        found, or the ``in_page_cursor`` conditions fail). Such a caller checks every page
        header it crosses as ``_check_page_header`` does (short headers of this timeline
        only) and reports with ``advance_walk``."""
        if self._find_first or self._prev is None:
            return None
        return self._segment_size, self._latest_page, self._latest_tli

    def advance_walk(self, pos: int, prev: int, latest_page: int) -> None:
        """The caller of ``walk_state`` took the records up to ``pos`` (the last one started
        at ``prev``), crossing page headers up to the one at ``latest_page`` (all of the
        timeline ``walk_state`` gave)."""
        if latest_page < self._latest_page or pos < self._pos:
            raise LocalProtocolError("advance_walk backwards")
        self._pos = self._last_end = pos
        self._prev = self._last_lsn = prev
        self._latest_page = latest_page

    def crossing_record(self) -> tuple[bytes, int, int, int] | None:
        """For the caller of ``in_page_cursor`` whose in-page walk stopped at the page's end:
        the record at ``pos`` if it crosses into the next page and ends there, as
        ``(raw, lsn, end_lsn, prev)`` -- its two pieces joined (without the page header
        between them), where it starts and ends (as ``DecodedRecord``), and the start of the
        record before it -- without building a ``DecodedRecord`` or a page header object.
        The decoder's checks of the general path are made here: all of the first piece and
        the next page's header and second piece at hand, ``xl_tot_len`` at least a record
        header and at most ``MAX_RECORD_LENGTH``, the next page's header as
        ``_read_page_header`` checks it (the same code: magic, info bits, long header at a
        segment start, ``xlp_pageaddr``, timeline sequence), ``XLP_FIRST_IS_CONTRECORD``
        without ``XLP_FIRST_IS_OVERWRITE_CONTRECORD``, ``xlp_rem_len`` equal to the bytes still
        to come, which all fit on that page. The caller checks the rest from ``raw`` as for an
        in-page record (``xl_prev`` equal to ``prev``, length, resource manager -- never an
        XLOG record here, whose XLOG_SWITCH would move the end --, CRC-32C, a body it can
        decode) and, if it takes the record, says so with ``take_crossing()``; nothing changes
        until then. Anything else -- unusual, invalid, incomplete, or more than one page
        boundary -- is ``None``: ``next_record`` then reads the record (or reports the end of
        WAL, or needs data) exactly as before."""
        if self._pending:
            self._merge()
        if (
            self._partial is not None
            or self._check_page_at is not None
            or self._ended is not None
            or self._prev is None
        ):
            return None
        pos = self._pos
        in_page = pos & _PAGE_MASK
        if not in_page:
            return None
        buf = self._buf
        o = pos - self._buf_lsn
        first = XLOG_BLCKSZ - in_page  # the first piece: the rest of this page
        if len(buf) - o < first:
            return None
        tot_len = _U32.unpack_from(buf, o)[0]
        rest = tot_len - first
        if rest <= 0 or tot_len < SIZE_OF_XLOG_RECORD or tot_len > MAX_RECORD_LENGTH:
            return None
        pageaddr = pos + first
        checked = self._check_page_header(pageaddr)
        if not isinstance(checked, tuple):
            return None
        info, tli, rem_len, size, sysid = checked
        if (
            info & (XLP_FIRST_IS_CONTRECORD | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
            != XLP_FIRST_IS_CONTRECORD
            or rem_len != rest
            or rest > XLOG_BLCKSZ - size
        ):
            return None
        at = o + first + size
        if len(buf) - at < rest:
            return None
        raw = buf[o : o + first] + buf[at : at + rest]
        if raw[17] == _RM_XLOG:  # xl_rmid
            return None
        end = (pageaddr + size + rest + 7) & ~7
        self._crossing = (end, pos, pageaddr, tli, sysid)
        return raw, pos, end, self._prev

    def take_crossing(self) -> None:
        """The caller took the record ``crossing_record`` just gave: go on after it."""
        crossing = self._crossing
        self._crossing = None
        if crossing is None or crossing[1] != self._pos:
            raise LocalProtocolError("take_crossing without crossing_record just before")
        end, lsn, pageaddr, tli, sysid = crossing
        self._page_header_read(pageaddr, tli, sysid)
        self._pos = self._last_end = end
        self._prev = self._last_lsn = lsn

    def finish(self) -> EndOfWal:
        """No more input will come: where does valid WAL end?"""
        if self._ended is not None:
            return self._ended
        item = self.next_record()
        while isinstance(item, DecodedRecord):
            item = self.next_record()
        if isinstance(item, EndOfWal):
            return item
        where = self._partial.lsn if self._partial is not None else self._pos
        return self._end(where, f"end of WAL input at {format_lsn(self._fed)}", truncated=True)

    def next_record(self) -> DecodedRecord | NeedData | EndOfWal:
        if self._ended is not None:
            return self._ended
        if self._pending:
            self._merge()
        while True:
            pos = self._pos
            if pos > self._fed:
                # Skipping ahead (after XLOG_SWITCH or over continuation pages).
                self._drop_until = pos
                self._buf = b""
                self._buf_lsn = self._fed
                return NEED_DATA
            if pos & _PAGE_MASK == 0 or self._check_page_at is not None:
                step = self._page_boundary(pos)
                if step is not None:
                    return step
                continue
            if self._partial is not None:
                item = self._continue_partial(pos)
            else:
                item = self._start_record(pos)
            if item is not None:
                return item

    # -- internals -----------------------------------------------------------------------

    def _end(self, error_lsn: int, reason: str, *, truncated: bool = False) -> EndOfWal:
        last = None if self._last_lsn is None else Lsn(self._last_lsn)
        self._ended = EndOfWal(Lsn(self._last_end), Lsn(error_lsn), reason, last, truncated)
        self._partial = None
        return self._ended

    def _where(self, pageaddr: int) -> str:
        seg = pageaddr // self._segment_size
        name = segment_file_name(seg, self._timeline, self._segment_size)
        return f"log segment {name}, offset {pageaddr % self._segment_size}"

    def _check_page_header(
        self, pageaddr: int
    ) -> tuple[int, int, int, int, int | None] | NeedData | str:
        """Read and check the page header at ``pageaddr`` without changing any state:
        ``(info, tli, rem_len, header size, sysid or None)``, ``NEED_DATA``, or the message of
        the first failed check (``page_fields_error``, then the timeline sequence). The one
        page header check: ``_read_page_header`` (the general path) and ``crossing_record``
        both use it."""
        o = pageaddr - self._buf_lsn
        buf = self._buf
        if len(buf) - o < SIZE_OF_SHORT_PHD:
            return NEED_DATA
        magic, info, tli, addr, rem_len = SHORT_PHD.unpack_from(buf, o)
        if info & XLP_LONG_HEADER:
            if len(buf) - o < SIZE_OF_LONG_PHD:
                return NEED_DATA
            sysid, seg_size, blcksz = LONG_PHD_TAIL.unpack_from(buf, o + 24)
            err = page_fields_error(
                magic, info, addr, seg_size, blcksz, pageaddr, self._segment_size, self._timeline
            )
            size = SIZE_OF_LONG_PHD
        else:
            sysid = None
            err = page_fields_error(
                magic, info, addr, None, None, pageaddr, self._segment_size, self._timeline
            )
            size = SIZE_OF_SHORT_PHD
        if err is not None:
            return err
        if sysid is not None and self.system_identifier not in (None, sysid):
            # (XLogReaderValidatePageHeader: WAL of another cluster spliced in)
            return (
                "WAL file is from different database system: WAL file database system "
                f"identifier is {sysid}, pg_control database system identifier is "
                f"{self.system_identifier}"
            )
        if pageaddr > self._latest_page and tli < self._latest_tli:
            return (
                f"out-of-sequence timeline ID {tli} (after {self._latest_tli}) in "
                + self._where(pageaddr)
            )
        return info, tli, rem_len, size, sysid

    def _page_header_read(self, pageaddr: int, tli: int, sysid: int | None) -> None:
        """Record that the page header at ``pageaddr`` passed ``_check_page_header``."""
        self._latest_page = pageaddr
        self._latest_tli = tli
        if sysid is not None and self.system_identifier is None:
            self.system_identifier = sysid

    def _read_page_header(self, pageaddr: int) -> XLogPageHeader | NeedData | EndOfWal:
        checked = self._check_page_header(pageaddr)
        if isinstance(checked, str):
            return self._end(pageaddr, checked)
        if not isinstance(checked, tuple):
            return checked
        info, tli, rem_len, _size, sysid = checked
        self._page_header_read(pageaddr, tli, sysid)
        if sysid is not None:
            return XLogPageHeader(
                XLOG_PAGE_MAGIC, info, tli, pageaddr, rem_len, sysid, self._segment_size,
                XLOG_BLCKSZ,
            )
        return XLogPageHeader(XLOG_PAGE_MAGIC, info, tli, pageaddr, rem_len)

    def _page_boundary(self, pos: int) -> NeedData | EndOfWal | DecodedRecord | None:
        """Handle the page header at ``pos`` (or the page being checked on a mid-page start)."""
        pageaddr = pos & ~_PAGE_MASK
        hdr = self._read_page_header(pageaddr)
        if not isinstance(hdr, XLogPageHeader):
            return hdr
        size = hdr.size
        if self._check_page_at is not None:
            self._check_page_at = None
            self._pos = self._start_lsn
            if (
                hdr.info & XLP_FIRST_IS_CONTRECORD
                and self._start_lsn == pageaddr + size
            ):
                return self._end(
                    self._start_lsn, f"contrecord is requested by {format_lsn(self._start_lsn)}"
                )
            if self._start_lsn < pageaddr + size:
                return self._end(
                    self._start_lsn,
                    f"invalid record offset at {format_lsn(self._start_lsn)}: expected at least"
                    f" {size}, got {self._start_lsn - pageaddr}",
                )
            return None
        if self._find_first:
            if hdr.info & XLP_FIRST_IS_CONTRECORD:
                skip = (hdr.rem_len + 7) & ~7
                if skip >= XLOG_BLCKSZ - size:
                    self._pos = pageaddr + XLOG_BLCKSZ
                    return None
                self._pos = pageaddr + size + skip
            else:
                self._pos = pageaddr + size
            self._find_first = False
            self._last_end = self._pos
            return None
        partial = self._partial
        if partial is None:
            # A record starts right after this header.
            self._pos = pageaddr + size
            if hdr.info & XLP_FIRST_IS_CONTRECORD:
                return self._end(self._pos, f"contrecord is requested by {format_lsn(self._pos)}")
            return None
        if hdr.info & XLP_FIRST_IS_OVERWRITE_CONTRECORD:
            # Recovery abandoned the record being read and wrote an OVERWRITE_CONTRECORD
            # record here instead: forget the partial record and read from this page.
            self._partial = None
            self._pos = pageaddr + size
            return None
        if not hdr.info & XLP_FIRST_IS_CONTRECORD:
            return self._end(pageaddr, f"there is no contrecord flag at {format_lsn(pageaddr)}")
        want = partial.total - partial.got
        if hdr.rem_len == 0 or hdr.rem_len != want:
            return self._end(
                pageaddr,
                f"invalid contrecord length {hdr.rem_len} (expected {want})"
                f" at {format_lsn(pageaddr)}",
            )
        self._pos = pageaddr + size
        return None

    def _header_error(self, lsn: int, tot_len: int, info: int, rmid: int, prev: int) -> str | None:
        """PostgreSQL's ``ValidXLogRecordHeader``."""
        if tot_len < SIZE_OF_XLOG_RECORD:
            return (
                f"invalid record length at {format_lsn(lsn)}: wanted {SIZE_OF_XLOG_RECORD},"
                f" got {tot_len}"
            )
        if not rmgr_id_is_valid(rmid):
            return f"invalid resource manager ID {rmid} at {format_lsn(lsn)}"
        expected = self._prev
        if expected is None:
            if not prev < lsn:
                return f"record with incorrect prev-link {format_lsn(prev)} at {format_lsn(lsn)}"
        elif prev != expected:
            return f"record with incorrect prev-link {format_lsn(prev)} at {format_lsn(lsn)}"
        return None

    def _start_record(self, pos: int) -> DecodedRecord | NeedData | EndOfWal | None:
        buf = self._buf
        o = pos - self._buf_lsn
        avail = len(buf) - o
        page_rem = XLOG_BLCKSZ - (pos & _PAGE_MASK)
        if page_rem >= SIZE_OF_XLOG_RECORD:
            if avail < SIZE_OF_XLOG_RECORD:
                return NEED_DATA
            hdr = XLOG_RECORD_HEADER.unpack_from(buf, o)
            tot_len, xid, prev, info, rmid, crc = hdr
            # The common case in one test; the full check names the failed rule.
            if not (
                tot_len >= SIZE_OF_XLOG_RECORD and rmid <= RM_MAX_BUILTIN_ID and prev == self._prev
            ):
                err = self._header_error(pos, tot_len, info, rmid, prev)
                if err is not None:
                    return self._end(pos, err)
            if tot_len <= page_rem:
                if avail < tot_len:
                    return NEED_DATA
                raw = buf[o : o + tot_len]
                end = (pos + tot_len + 7) & ~7
                # The hot path, _complete inlined: a bad CRC, an XLOG record (XLOG_SWITCH) or
                # an undecodable body go to _complete, which does it all again and reports.
                crc32c = _crcmod.crc32c
                if rmid == _RM_XLOG or crc32c(raw[:20], crc32c(raw[SIZE_OF_XLOG_RECORD:])) != crc:
                    return self._complete(raw, pos, end, hdr)
                try:
                    blocks, main_data, origin, top_xid = decode_body(raw, pos)
                except RemoteProtocolError:
                    return self._complete(raw, pos, end, hdr)
                self._pos = end
                self._prev = pos
                self._last_lsn = pos
                self._last_end = end
                return _new_record(
                    pos, end, tot_len, xid, prev, info, rmid, crc, blocks, main_data, origin,
                    top_xid, raw,
                )
            checked = True
        else:
            # Only xl_tot_len is guaranteed to be on this page.
            if avail < 4:
                return NEED_DATA
            tot_len = int.from_bytes(buf[o : o + 4], "little")
            if tot_len < SIZE_OF_XLOG_RECORD:
                return self._end(
                    pos,
                    f"invalid record length at {format_lsn(pos)}: wanted {SIZE_OF_XLOG_RECORD},"
                    f" got {tot_len}",
                )
            checked = False
        if tot_len > MAX_RECORD_LENGTH:
            return self._end(pos, f"record length {tot_len} at {format_lsn(pos)} too long")
        if avail < page_rem:
            return NEED_DATA
        self._partial = _Partial(pos, tot_len, [buf[o : o + page_rem]], page_rem, checked)
        self._pos = pos + page_rem
        return None

    def _continue_partial(self, pos: int) -> DecodedRecord | NeedData | EndOfWal | None:
        partial = self._partial
        assert partial is not None
        buf = self._buf
        o = pos - self._buf_lsn
        piece = min(partial.total - partial.got, XLOG_BLCKSZ - (pos & _PAGE_MASK))
        if len(buf) - o < piece:
            return NEED_DATA
        partial.parts.append(buf[o : o + piece])
        partial.got += piece
        self._pos = pos + piece
        if not partial.header_checked and partial.got >= SIZE_OF_XLOG_RECORD:
            head = b"".join(partial.parts)[:SIZE_OF_XLOG_RECORD]
            tot_len, _xid, prev, info, rmid, _crc = XLOG_RECORD_HEADER.unpack_from(head)
            err = self._header_error(partial.lsn, tot_len, info, rmid, prev)
            if err is not None:
                return self._end(partial.lsn, err)
            partial.header_checked = True
        if partial.got < partial.total:
            return None
        self._partial = None
        raw = b"".join(partial.parts)
        hdr = XLOG_RECORD_HEADER.unpack_from(raw)
        return self._complete(raw, partial.lsn, (self._pos + 7) & ~7, hdr)

    def _complete(
        self, raw: bytes, lsn: int, end: int, hdr: tuple[int, int, int, int, int, int]
    ) -> DecodedRecord | EndOfWal:
        tot_len, xid, prev, info, rmid, crc = hdr
        if record_crc(raw) != crc:
            return self._end(
                lsn, f"incorrect resource manager data checksum in record at {format_lsn(lsn)}"
            )
        try:
            blocks, main_data, origin, top_xid = decode_body(raw, lsn)
        except RemoteProtocolError as exc:
            return self._end(lsn, exc.msg)
        if rmid == _RM_XLOG and info & 0xF0 == XLOG_SWITCH:
            # The rest of the segment is unused; the next record starts the next segment.
            end = (lsn // self._segment_size + 1) * self._segment_size
        self._pos = end
        self._prev = lsn
        self._last_lsn = lsn
        self._last_end = end
        return _new_record(
            lsn, end, tot_len, xid, prev, info, rmid, crc, blocks, main_data, origin, top_xid, raw
        )
