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
from libc.string cimport strcmp
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

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

__all__ = ["IMPL", "crc32c", "crc32c_kernel", "scan_records"]

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
