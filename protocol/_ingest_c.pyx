# The pageserver's ingest kernel in Cython: the compiled twin of protocol/_ingest_py.py (the
# reference: contract, argument checks and messages).
#
# Same names, signatures, results and error classes as the twin; tests/protocol/
# test_native_ingest.py runs both on the same bytes. Every offset is checked against the
# buffer's length in 64-bit arithmetic before a pointer moves (native.md 6.1); the loop over a
# run is short (the records of one WAL page), so it keeps the GIL.
"""The pageserver's ingest kernel, compiled (see protocol/_ingest_py.py for the reference)."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport getenv
from libc.string cimport memcmp, strcmp
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF

cdef extern from "_crc32c.h":
    int ps_crc32c_choose(int force_software) nogil
    uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t length) nogil

cdef extern from "_bytes.h":
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

from protocol._ingest_py import check_run_args

__all__ = ["IMPL", "same_run"]

IMPL = "native"
SOURCE_HASH = ps_source_hash.decode("ascii")

cdef enum:
    RECORD_HEADER = 24
    # compared per record: (xl_tot_len, xl_xid) at 0, (xl_info, xl_rmid, pad) at 16, the 22
    # layout bytes at 24; xl_prev at 8 is a chain, xl_crc at 20 is checked
    RUN_COMPARED = 46


cdef int _choose_crc() except -1:
    # as protocol/_wal_c.pyx: PAGESTORE_CRC32C_SW=1 forces the table kernel; exactly 1 or unset
    cdef const char *sw = getenv(b"PAGESTORE_CRC32C_SW")
    if sw != NULL and strcmp(sw, b"1") != 0:
        raise ImportError(
            f"PAGESTORE_CRC32C_SW={sw.decode('utf-8', 'replace')!r}: set it to 1 to force the "
            "table CRC-32C kernel, or unset it to use SSE4.2 where the CPU has it"
        )
    ps_crc32c_choose(1 if sw != NULL else 0)
    return 0


_choose_crc()


cdef inline uint32_t _record_crc(const unsigned char *r, Py_ssize_t tot_len) noexcept nogil:
    # PostgreSQL's order: the payload after the header, then the header up to xl_crc
    cdef uint32_t c = ps_crc32c(0, r + RECORD_HEADER, <size_t>(tot_len - RECORD_HEADER))
    return ps_crc32c(c, r, 20)


def same_run(buf, o, pos, tot_len, stride, k, vm_at):
    """The run of records like the one at ``o``: ``(m, raws)``.

    See protocol/_ingest_py.py ``same_run`` (the reference) for the contract."""
    cdef const uint8_t[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t size = view.shape[0]
    check_run_args(size, o, pos, tot_len, stride, k, vm_at)
    # (checked: 0 <= o, o + k * stride + tot_len <= size, pos + k * stride < 2**64)
    cdef Py_ssize_t off = o, n = tot_len, step = stride, count = k, vm = vm_at
    cdef uint64_t lsn = pos
    cdef const unsigned char *base = &view[0]
    cdef const unsigned char *one = base + off
    cdef const unsigned char *r
    cdef Py_ssize_t m = 0
    while m < count:
        r = one + (m + 1) * step
        if (
            memcmp(r, one, 8) != 0
            or memcmp(r + 16, one + 16, 4) != 0
            or memcmp(r + 24, one + 24, RUN_COMPARED - 24) != 0
            or ps_le64(r + 8) != lsn + <uint64_t>(m * step)
            or (vm > 0 and r[vm] & 0x01)
            or _record_crc(r, n) != ps_le32(r + 20)
        ):
            break
        m += 1
    raws = PyTuple_New(m + 1)
    cdef Py_ssize_t j
    for j in range(m + 1):
        raw = PyBytes_FromStringAndSize(<const char *>(one + j * step), n)
        Py_INCREF(raw)  # PyTuple_SET_ITEM steals a reference
        PyTuple_SET_ITEM(raws, j, raw)
    return m, raws
