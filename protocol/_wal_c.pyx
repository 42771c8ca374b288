# WAL kernels in Cython: the compiled twin of protocol/_wal_py.py (the reference).
#
# Same names, signatures, results and error classes as the twin; tests/protocol/
# test_native_wal.py runs both on the same bytes. Every length read from the input is checked
# against the bytes that remain, in 64-bit arithmetic, before a pointer moves (native.md 6.1).
# The loops run without the GIL: the caller's buffer is held through a typed memoryview for
# the whole call, so it cannot be resized underneath.
"""WAL kernels, compiled (see protocol/_wal_py.py for the reference and the docs)."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport getenv
from libc.string cimport memcpy, strcmp
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc

cdef extern from "_crc32c.h":
    int ps_crc32c_choose(int force_software) nogil
    uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t length) nogil
    int ps_crc32c_hardware

cdef extern from "_bytes.h":
    uint16_t ps_le16(const unsigned char *p) nogil
    uint32_t ps_le32(const unsigned char *p) nogil
    uint64_t ps_le64(const unsigned char *p) nogil

cdef extern from *:
    """
    /* setup.py defines PAGESTORE_SOURCE_HASH: the hash of this module's sources, which
       protocol._native compares with the files on disk to refuse a stale build. */
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_source_hash

__all__ = ["IMPL", "RecordTracker", "crc32c", "crc32c_kernel", "scan_records"]

IMPL = "native"
SOURCE_HASH = ps_source_hash.decode("ascii")

cdef enum:
    XLOG_BLCKSZ = 8192
    SHORT_PHD = 24
    RECORD_HEADER = 24
    XLOG_PAGE_MAGIC = 0xD110
    XLP_FIRST_IS_CONTRECORD = 0x0001
    XLP_LONG_HEADER = 0x0002
    XLP_ALL_FLAGS = 0x000F
    XLOG_SWITCH = 0x40
    RM_XLOG_ID = 0
    PAGE_ROOM = XLOG_BLCKSZ - SHORT_PHD

# CRC-32C over a message followed by its own CRC (little-endian): see the twin.
cdef uint32_t CRC_RESIDUE = 0x48674BC7
cdef uint16_t BAD_CONT_INFO = <uint16_t>((~XLP_ALL_FLAGS | XLP_LONG_HEADER) & 0xFFFF)


cdef int _choose_crc() except -1:
    # PAGESTORE_CRC32C_SW=1 forces the table kernel (tests of the fallback); exactly 1 or unset.
    cdef const char *sw = getenv(b"PAGESTORE_CRC32C_SW")
    if sw != NULL and strcmp(sw, b"1") != 0:
        raise ImportError(
            f"PAGESTORE_CRC32C_SW={sw.decode('utf-8', 'replace')!r}: set it to 1 to force the "
            "table CRC-32C kernel, or unset it to use SSE4.2 where the CPU has it"
        )
    ps_crc32c_choose(1 if sw != NULL else 0)
    return 0


_choose_crc()


def crc32c_kernel():
    """Which CRC-32C kernel this module runs: ``"sse4.2"`` or ``"table"``."""
    return "sse4.2" if ps_crc32c_hardware else "table"


def crc32c(data, value=0):
    """CRC-32C of ``data``, continuing from ``value`` (the previous call's result)."""
    cdef uint32_t v = value  # OverflowError outside [0, 2**32), as the twin
    cdef Py_buffer view
    cdef uint32_t out
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= 65536:
            with nogil:
                out = ps_crc32c(v, <const unsigned char *>view.buf, <size_t>view.len)
        else:
            out = ps_crc32c(v, <const unsigned char *>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return out


def scan_records(buf, i, n, base, seg_size):
    """Walk complete records in ``buf[i:n]``; returns ``(index, last_end, bad)``.

    See protocol/_wal_py.py ``scan_records`` (the reference) for the contract."""
    # as the twin: any C-contiguous buffer, seen as bytes (TypeError otherwise)
    cdef const uint8_t[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t buf_len = view.shape[0]
    if not (0 <= i <= n <= buf_len):
        raise ValueError(f"scan range [{i}, {n}) is not inside a buffer of {buf_len} bytes")
    if seg_size <= 0 or seg_size % XLOG_BLCKSZ:
        raise ValueError(f"segment size {seg_size} is not a positive multiple of {XLOG_BLCKSZ}")
    if base < 0 or base + n >= (1 << 64):
        raise ValueError(f"base LSN {base:#x} + {n} is not a 64-bit LSN")
    if (base + i) % 8:
        raise ValueError(f"record start {base + i:#x} is not MAXALIGNed")
    cdef int64_t ci = i
    cdef int64_t cn = n
    cdef uint64_t cbase = base
    cdef uint64_t cseg = seg_size
    cdef int64_t out_i = 0, out_last = -1, out_bad = -1
    cdef const unsigned char *p = &view[0] if buf_len else NULL
    with nogil:
        _scan(p, ci, cn, cbase, cseg, &out_i, &out_last, &out_bad)
    return out_i, out_last, out_bad


cdef inline bint _crc_ok(uint32_t crc_of_body, const unsigned char *hdr) noexcept nogil:
    return ps_crc32c(crc_of_body, hdr, RECORD_HEADER) == CRC_RESIDUE


cdef void _scan(const unsigned char *buf, int64_t i, int64_t n, uint64_t base, uint64_t seg_size,
                int64_t *out_i, int64_t *out_last, int64_t *out_bad) noexcept nogil:
    # Mirrors the twin's loop line by line; all positions are indices in [0, n] and all
    # lengths are widened to int64 before they are added, so nothing can overflow.
    cdef int64_t last_end = -1
    cdef int64_t in_page, page_end, stop, end, body, left, p, piece, take
    cdef int64_t tot_len
    cdef uint8_t info, rmid
    cdef uint16_t magic, pinfo
    cdef uint64_t pageaddr
    cdef uint32_t rem_len, crc
    while True:
        in_page = <int64_t>((base + <uint64_t>i) % XLOG_BLCKSZ)
        if in_page == 0:
            break
        page_end = i + XLOG_BLCKSZ - in_page
        stop = page_end if page_end < n else n
        while stop - i >= RECORD_HEADER:
            tot_len = ps_le32(buf + i)
            info = buf[i + 16]
            rmid = buf[i + 17]
            end = i + tot_len
            if tot_len < RECORD_HEADER or end > stop:
                break
            if rmid == RM_XLOG_ID and (info & 0xF0) == XLOG_SWITCH:
                break
            body = i + RECORD_HEADER
            if not _crc_ok(ps_crc32c(0, buf + body, <size_t>(end - body)), buf + i):
                out_i[0] = i
                out_last[0] = last_end
                out_bad[0] = i
                return
            last_end = i + ((tot_len + 7) & ~7)
            if last_end > n:
                out_i[0] = end
                out_last[0] = last_end
                out_bad[0] = -1
                return
            i = last_end
        if page_end - i < RECORD_HEADER or n - i < RECORD_HEADER:
            break
        tot_len = ps_le32(buf + i)
        info = buf[i + 16]
        rmid = buf[i + 17]
        end = i + tot_len
        if end <= page_end or end > n or (rmid == RM_XLOG_ID and (info & 0xF0) == XLOG_SWITCH):
            break
        body = i + RECORD_HEADER
        crc = ps_crc32c(0, buf + body, <size_t>(page_end - body))
        left = end - page_end
        p = page_end
        while left:
            piece = p + SHORT_PHD
            if piece > n or (base + <uint64_t>p) % seg_size == 0:
                break
            magic = ps_le16(buf + p)
            pinfo = ps_le16(buf + p + 2)
            pageaddr = ps_le64(buf + p + 8)
            rem_len = ps_le32(buf + p + 16)
            if (magic != XLOG_PAGE_MAGIC or pageaddr != base + <uint64_t>p
                    or (pinfo & BAD_CONT_INFO) or not (pinfo & XLP_FIRST_IS_CONTRECORD)
                    or <int64_t>rem_len != left):
                break
            take = left if left < PAGE_ROOM else PAGE_ROOM
            p = piece + take
            if p > n:
                break
            crc = ps_crc32c(crc, buf + piece, <size_t>take)
            left -= take
        if left:
            break
        if not _crc_ok(crc, buf + i):
            out_i[0] = i
            out_last[0] = last_end
            out_bad[0] = i
            return
        last_end = <int64_t>(((base + <uint64_t>p + 7) & ~(<uint64_t>7)) - base)
        if last_end > n:
            out_i[0] = p
            out_last[0] = last_end
            out_bad[0] = -1
            return
        i = last_end
    out_i[0] = i
    out_last[0] = last_end
    out_bad[0] = -1


# -- RecordTracker -------------------------------------------------------------------------
# A line-by-line mirror of the twin's state machine (protocol/_wal_py.py), in C fields. The
# loop runs without the GIL; an error is recorded as a code and its values, and raised as the
# twin's InvalidWal (same message) once the GIL is back. LSN arithmetic is unsigned 64-bit;
# every take is the minimum of what is left of the buffer, the page and the item.

from protocol.wal.errors import InvalidWal

cdef extern from *:
    """
    #define PS_WAL_SEGMENT_SIZE (16u * 1024u * 1024u)
    """
    uint64_t PS_WAL_SEGMENT_SIZE

cdef enum:
    LONG_PHD = 40
    XLP_FIRST_IS_OVERWRITE_CONTRECORD = 0x0008
    ST_PAGE_HDR = 0
    ST_REC_HDR = 1
    ST_REC_BODY = 2
    ST_SKIP = 3
    E_NONE = 0
    E_REC_LEN = 1
    E_CRC_AT = 2
    E_MAGIC = 3
    E_ADDR = 4
    E_INFO = 5
    E_LONG = 6
    E_SEG = 7
    E_SPLIT = 8
    E_MISSING = 9
    E_UNEXPECTED = 10
    E_CRC_ENDING = 11

cdef uint32_t MAX_RECORD_LEN = 0x3FFFFFFF


cdef inline int64_t _min(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


def _where(page_lsn):
    return f"WAL page at {page_lsn >> 32:X}/{page_lsn & 0xFFFFFFFF:X}"


cdef class RecordTracker:
    """Streaming record-boundary finder with CRC checks (the safekeeper's
    ``safekeeper.record_tracker``, whose docstring has the contract)."""

    cdef public uint64_t pos
    cdef public uint64_t record_end
    cdef readonly uint64_t seg_size
    cdef unsigned char phdr[LONG_PHD]
    cdef int phdr_got
    cdef int phdr_len
    cdef unsigned char rhdr[RECORD_HEADER]
    cdef int rhdr_got
    cdef uint32_t tot_len
    cdef int64_t body_left
    cdef uint32_t crc
    cdef uint64_t skip_to
    cdef int state
    cdef int after_page
    # the last error: its code and values
    cdef int err
    cdef uint64_t err_lsn
    cdef uint64_t err_a
    cdef uint64_t err_b

    def __init__(self, start_lsn, seg_size=PS_WAL_SEGMENT_SIZE):
        if start_lsn % 8 or not 0 <= start_lsn < (1 << 64):
            raise ValueError(f"record boundary {start_lsn:#x} is not a MAXALIGNed LSN")
        if seg_size <= 0 or seg_size % XLOG_BLCKSZ or seg_size >= (1 << 32):
            raise ValueError(f"segment size {seg_size} is not a positive multiple of {XLOG_BLCKSZ}")
        self.seg_size = seg_size
        self.pos = start_lsn
        self.record_end = start_lsn
        self.phdr_got = 0
        self.phdr_len = 0
        self.rhdr_got = 0
        self.tot_len = 0
        self.body_left = 0
        self.crc = 0
        self.skip_to = 0
        self.state = ST_REC_HDR
        self.after_page = ST_REC_HDR
        self.err = E_NONE
        if self.pos % XLOG_BLCKSZ == 0:
            self._enter_page_header()

    def feed(self, data):
        """Consume ``data`` (the bytes at ``self.pos``); return the new ``record_end``."""
        cdef const uint8_t[::1] view = memoryview(data).cast("B")
        cdef int64_t n = view.shape[0]
        cdef int rc
        if n == 0:
            return self.record_end
        if n >= 65536:
            with nogil:
                rc = self._run(&view[0], n)
        else:
            rc = self._run(&view[0], n)
        if rc != E_NONE:
            raise self._error()
        return self.record_end

    def feed_many(self, chunks):
        """``feed`` each of ``chunks`` in order, in one call and (at 64 KiB or more in all) one
        stretch without the GIL: a WAL writer thread that took the GIL back after every chunk
        would wait for it each time the event loop holds it. Returns ``(fed, good_end,
        error)``: the chunks consumed without error, ``record_end`` before the chunk that
        failed (or after the last one), and that chunk's ``InvalidWal`` (None if none)."""
        cdef Py_ssize_t count = len(chunks)
        cdef Py_ssize_t i, got = 0, fed = 0
        cdef int64_t total = 0
        cdef uint64_t good_end = self.record_end
        cdef int rc = E_NONE
        cdef Py_buffer *bufs
        if count == 0:
            return 0, self.record_end, None
        bufs = <Py_buffer *>PyMem_Malloc(count * sizeof(Py_buffer))
        if bufs == NULL:
            raise MemoryError()
        try:
            for i in range(count):
                PyObject_GetBuffer(chunks[i], &bufs[i], PyBUF_SIMPLE)
                got += 1
                total += bufs[i].len
            if total >= 65536:
                with nogil:
                    fed = self._run_many(bufs, count, &good_end, &rc)
            else:
                fed = self._run_many(bufs, count, &good_end, &rc)
        finally:
            for i in range(got):
                PyBuffer_Release(&bufs[i])
            PyMem_Free(bufs)
        if rc != E_NONE:
            return fed, good_end, self._error()
        return fed, self.record_end, None

    cdef Py_ssize_t _run_many(
        self, Py_buffer *bufs, Py_ssize_t count, uint64_t *good_end, int *rc
    ) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(count):
            good_end[0] = self.record_end
            if bufs[i].len == 0:
                continue
            rc[0] = self._run(<const unsigned char *>bufs[i].buf, bufs[i].len)
            if rc[0] != E_NONE:
                return i
        return count

    cdef object _error(self):
        cdef int code = self.err
        lsn, a, b = self.err_lsn, self.err_a, self.err_b
        if code == E_REC_LEN:
            return InvalidWal(f"invalid record length {a} at {lsn:#x}")
        if code == E_CRC_AT:
            return InvalidWal(f"record CRC mismatch for the record at {lsn:#x}")
        if code == E_CRC_ENDING:
            return InvalidWal(f"record CRC mismatch for the record ending at {lsn:#x}")
        if code == E_MAGIC:
            return InvalidWal(f"bad page magic {a:#06x} on {_where(lsn)}")
        if code == E_ADDR:
            return InvalidWal(f"page address {a:#x} on {_where(lsn)}")
        if code == E_INFO:
            return InvalidWal(f"invalid page info bits {a:#x} on {_where(lsn)}")
        if code == E_LONG:
            return InvalidWal(f"long header flag {bool(a)} does not fit {_where(lsn)}")
        if code == E_SEG:
            return InvalidWal(f"segment size {a} / block size {b} on {_where(lsn)}")
        if code == E_SPLIT:
            return InvalidWal(f"record length split across pages before {_where(lsn)}")
        if code == E_MISSING:
            return InvalidWal(f"missing continuation ({a} of {b} bytes) on {_where(lsn)}")
        if code == E_UNEXPECTED:
            return InvalidWal(f"unexpected continuation record on {_where(lsn)}")
        return AssertionError(f"unknown tracker error code {code}")

    cdef inline int _fail(self, int code, uint64_t lsn, uint64_t a, uint64_t b) noexcept nogil:
        self.err = code
        self.err_lsn = lsn
        self.err_a = a
        self.err_b = b
        return code

    cdef inline void _enter_page_header(self) noexcept nogil:
        self.after_page = self.state
        self.state = ST_PAGE_HDR
        self.phdr_got = 0
        self.phdr_len = LONG_PHD if self.pos % self.seg_size == 0 else SHORT_PHD

    cdef int _run(self, const unsigned char *buf, int64_t n) noexcept nogil:
        cdef int64_t i = 0
        cdef int64_t take, pad, page_left, ni = 0, last = -1, bad = -1
        cdef uint64_t pos, base, tot
        cdef int rc
        while i < n:
            pos = self.pos
            page_left = <int64_t>(XLOG_BLCKSZ - pos % XLOG_BLCKSZ)
            if self.state == ST_REC_BODY:
                take = _min(_min(self.body_left, n - i), page_left)
                self.crc = ps_crc32c(self.crc, buf + i, <size_t>take)
                i += take
                self.pos = pos + <uint64_t>take
                self.body_left -= take
                if self.body_left == 0:
                    rc = self._finish_record()
                    if rc != E_NONE:
                        return rc
                elif take == page_left:
                    self._enter_page_header()
            elif self.state == ST_PAGE_HDR:
                take = _min(self.phdr_len - self.phdr_got, n - i)
                memcpy(self.phdr + self.phdr_got, buf + i, <size_t>take)
                self.phdr_got += <int>take
                i += take
                self.pos = pos + <uint64_t>take
                if self.phdr_got == self.phdr_len:
                    rc = self._check_page_header(self.pos - <uint64_t>self.phdr_len)
                    if rc != E_NONE:
                        return rc
            elif self.state == ST_REC_HDR:
                if self.rhdr_got == 0:
                    if pos & 7:
                        pad = <int64_t>(8 - (pos & 7))
                        if pad > n - i:
                            self.skip_to = pos + <uint64_t>pad
                            self.state = ST_SKIP
                            continue
                        i += pad
                        pos = pos + <uint64_t>pad
                        self.pos = pos
                        if pos % XLOG_BLCKSZ == 0:
                            self._enter_page_header()
                            continue
                        page_left -= pad
                    # Fast path: whole records on this page and in this buffer.
                    if n - i >= RECORD_HEADER:
                        base = pos - <uint64_t>i
                        _scan(buf, i, n, base, self.seg_size, &ni, &last, &bad)
                        if last >= 0:
                            self.record_end = base + <uint64_t>last
                        if bad >= 0:
                            return self._fail(E_CRC_AT, base + <uint64_t>bad, 0, 0)
                        i = ni
                        pos = base + <uint64_t>ni
                        if pos != self.pos:
                            self.pos = pos
                            if pos % XLOG_BLCKSZ == 0:
                                self._enter_page_header()
                            continue
                take = _min(_min(RECORD_HEADER - self.rhdr_got, n - i), page_left)
                memcpy(self.rhdr + self.rhdr_got, buf + i, <size_t>take)
                self.rhdr_got += <int>take
                i += take
                self.pos = pos + <uint64_t>take
                if self.rhdr_got >= 4 and self.tot_len == 0:
                    tot = ps_le32(self.rhdr)
                    if tot < RECORD_HEADER or tot > MAX_RECORD_LEN:
                        return self._fail(E_REC_LEN, pos, tot, 0)
                    self.tot_len = <uint32_t>tot
                if self.rhdr_got == RECORD_HEADER:
                    self.body_left = <int64_t>self.tot_len - RECORD_HEADER
                    self.crc = 0
                    self.state = ST_REC_BODY
                    if self.body_left == 0:
                        rc = self._finish_record()
                        if rc != E_NONE:
                            return rc
                        continue
                if take == page_left:
                    self._enter_page_header()
            else:  # ST_SKIP
                take = _min(<int64_t>(self.skip_to - pos), n - i)
                i += take
                self.pos = pos + <uint64_t>take
                if self.pos == self.skip_to:
                    self.state = ST_REC_HDR
                    if self.pos % self.seg_size == 0:
                        # The end of an XLOG_SWITCH record's segment.
                        self.record_end = self.pos
                    if self.pos % XLOG_BLCKSZ == 0:
                        self._enter_page_header()
        return E_NONE

    cdef int _check_page_header(self, uint64_t page_lsn) noexcept nogil:
        cdef uint16_t magic = ps_le16(self.phdr)
        cdef uint16_t info = ps_le16(self.phdr + 2)
        cdef uint64_t pageaddr = ps_le64(self.phdr + 8)
        cdef uint32_t rem_len = ps_le32(self.phdr + 16)
        cdef bint is_long
        cdef uint32_t seg, blcksz
        cdef int resume
        cdef bint in_record
        cdef int64_t left
        if magic != XLOG_PAGE_MAGIC:
            return self._fail(E_MAGIC, page_lsn, magic, 0)
        if pageaddr != page_lsn:
            return self._fail(E_ADDR, page_lsn, pageaddr, 0)
        if info & ~(<uint16_t>XLP_ALL_FLAGS):
            return self._fail(E_INFO, page_lsn, info, 0)
        is_long = (info & XLP_LONG_HEADER) != 0
        if is_long != (page_lsn % self.seg_size == 0):
            return self._fail(E_LONG, page_lsn, is_long, 0)
        if is_long:
            seg = ps_le32(self.phdr + SHORT_PHD + 8)
            blcksz = ps_le32(self.phdr + SHORT_PHD + 12)
            if seg != self.seg_size or blcksz != XLOG_BLCKSZ:
                return self._fail(E_SEG, page_lsn, seg, blcksz)
        resume = self.after_page
        in_record = resume == ST_REC_BODY or (resume == ST_REC_HDR and self.rhdr_got > 0)
        if in_record and (info & XLP_FIRST_IS_OVERWRITE_CONTRECORD):
            # An OVERWRITE_CONTRECORD page: drop the unfinished record (see the twin).
            self.rhdr_got = 0
            self.tot_len = 0
            self.body_left = 0
            self.crc = 0
            self.state = ST_REC_HDR
            return E_NONE
        if in_record:
            left = (<int64_t>self.tot_len - self.rhdr_got) if resume == ST_REC_HDR else self.body_left
            if self.tot_len == 0:
                return self._fail(E_SPLIT, page_lsn, 0, 0)
            if not (info & XLP_FIRST_IS_CONTRECORD) or <int64_t>rem_len != left:
                return self._fail(E_MISSING, page_lsn, rem_len, <uint64_t>left)
            self.state = resume
        else:
            if info & XLP_FIRST_IS_CONTRECORD:
                return self._fail(E_UNEXPECTED, page_lsn, 0, 0)
            self.state = ST_REC_HDR
        return E_NONE

    cdef int _finish_record(self) noexcept nogil:
        cdef uint32_t crc = ps_crc32c(self.crc, self.rhdr, 20)
        cdef uint32_t stored = ps_le32(self.rhdr + 20)
        cdef bint is_switch
        if crc != stored:
            return self._fail(E_CRC_ENDING, self.pos, 0, 0)
        is_switch = self.rhdr[17] == RM_XLOG_ID and (self.rhdr[16] & 0xF0) == XLOG_SWITCH
        self.rhdr_got = 0
        self.tot_len = 0
        self.state = ST_REC_HDR
        if is_switch and self.pos % self.seg_size:
            # The rest of the segment is padding; the next record starts on the next segment.
            self.skip_to = (self.pos // self.seg_size + 1) * self.seg_size
            self.state = ST_SKIP
        else:
            self.record_end = (self.pos + 7) & ~(<uint64_t>7)
        if self.pos % XLOG_BLCKSZ == 0:
            self._enter_page_header()
        return E_NONE
