# The page service's image fast path in one layer, compiled: the twin of
# pageserver/storage/_images_py.py (the reference, which documents the behaviour). Same names,
# results and error classes (tests/pageserver/test_native_images.py). The search holds the GIL
# (the block cache is a Python dict); the reads and the CRC checks run without it. Every entry
# is read only below its block's length (whole entries), offsets and lengths are compared in
# 64-bit unsigned arithmetic without a sum that could wrap (native.md 6.1).
"""The image fast path of a batch in one layer, compiled (see pageserver/storage/_images_py.py)."""

from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcmp, memcpy, memset
from libc.errno cimport errno, EAGAIN, EINTR, EOPNOTSUPP, EINVAL
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check,
                            PyBytes_FromStringAndSize)
from cpython.dict cimport PyDict_GetItem, PyDict_CheckExact
from cpython.object cimport PyObject

cdef extern from "../../protocol/_bytes.h":
    uint32_t ps_be32(const unsigned char *p) nogil
    uint64_t ps_be64(const unsigned char *p) nogil

cdef extern from "../../protocol/_crc32c.h":
    int ps_crc32c_choose(int force_software) nogil
    uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t length) nogil

cdef extern from *:
    """
    #include <sys/uio.h>
    #include <fcntl.h>
    #include <unistd.h>
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_images_source_hash = PAGESTORE_SOURCE_HASH;
    static ssize_t ps_preadv_nowait(int fd, const struct iovec *iov, int n, int64_t offset)
    {
    #ifdef RWF_NOWAIT
        return preadv2(fd, iov, n, (off_t)offset, RWF_NOWAIT);
    #else
        errno = EOPNOTSUPP;
        return -1;
    #endif
    }
    """
    const char *ps_images_source_hash
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t ps_preadv_nowait(int fd, const iovec *iov, int n, int64_t offset) nogil

from collections import OrderedDict
import os

__all__ = ["BLCKSZ", "IMPL", "MAX_RUN", "read_images", "read_images_into"]

IMPL = "native"
SOURCE_HASH = ps_images_source_hash.decode("ascii")
BLCKSZ = 8192
MAX_RUN = 256

ps_crc32c_choose(1 if os.environ.get("PAGESTORE_CRC32C_SW") == "1" else 0)

DEF C_ENTRY = 42
DEF C_KEY = 18
DEF C_PREFIX = 26
DEF C_BLCKSZ = 8192
DEF C_BLOB = 8193
DEF C_MAX_RUN = 256

cdef enum:
    R_OK = 0
    R_SHORT = 1      # cold or the file ended: this run and the later ones declined
    R_UNSUPPORTED = 2
    R_OSERROR = 3


cdef struct Planned:
    Py_ssize_t index     # the request's position
    uint64_t off
    uint32_t crc
    unsigned char *page  # the bytes object's buffer
    unsigned char tag
    bint ok


# bytes ordering (what Python compares): memcmp of the common length, then the shorter first
cdef inline int _cmp(const unsigned char *a, Py_ssize_t na, const unsigned char *b,
                     Py_ssize_t nb) noexcept:
    cdef Py_ssize_t n = na if na < nb else nb
    cdef int c = memcmp(a, b, <size_t>n) if n else 0
    if c:
        return c
    return (na > nb) - (na < nb)


cdef Py_ssize_t _fence_bisect_right(list fences, const unsigned char *x, Py_ssize_t nx) except -2:
    cdef Py_ssize_t lo = 0, hi = len(fences), mid
    cdef object f
    while lo < hi:
        mid = (lo + hi) // 2
        f = fences[mid]
        if not PyBytes_Check(f):
            raise TypeError("'<' not supported between instances of 'bytes' and '%s'" % type(f).__name__)
        if _cmp(x, nx, <const unsigned char *>PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f)) < 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef inline Py_ssize_t _entry_bisect_left(const unsigned char *raw, Py_ssize_t n,
                                          const unsigned char *x) noexcept:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if memcmp(raw + mid * C_ENTRY, x, C_PREFIX) < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef uint64_t _u64(str name, object value) except? 0xFFFFFFFFFFFFFFFF:
    if not 0 <= value <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"{name} {value} is outside u64")
    return <uint64_t>value


cdef int _read_all(int fd, Planned *plan, Py_ssize_t n, Py_ssize_t *calls, int64_t *nbytes,
                   iovec *iov, int *err) noexcept nogil:
    """The runs of adjacent blobs, one preadv2(RWF_NOWAIT) each, and the checks; stops at the
    first run that does not come back whole."""
    cdef Py_ssize_t at = 0, end, j
    cdef ssize_t got
    cdef int64_t total
    while at < n:
        end = at + 1
        while end < n and end - at < C_MAX_RUN and plan[end].off == plan[end - 1].off + C_BLOB:
            end += 1
        for j in range(at, end):
            iov[2 * (j - at)].iov_base = &plan[j].tag
            iov[2 * (j - at)].iov_len = 1
            iov[2 * (j - at) + 1].iov_base = plan[j].page
            iov[2 * (j - at) + 1].iov_len = C_BLCKSZ
        total = <int64_t>(end - at) * C_BLOB
        calls[0] += 1
        while True:
            got = ps_preadv_nowait(fd, iov, <int>(2 * (end - at)), <int64_t>plan[at].off)
            if got < 0 and errno == EINTR:
                continue
            break
        if got < 0:
            err[0] = errno
            if errno == EAGAIN:
                return R_SHORT
            if errno == EOPNOTSUPP or errno == EINVAL:
                return R_UNSUPPORTED
            return R_OSERROR
        nbytes[0] += got
        if got != total:
            return R_SHORT
        for j in range(at, end):
            plan[j].ok = plan[j].tag == 0 and ps_crc32c(
                ps_crc32c(0, &plan[j].tag, 1), plan[j].page, C_BLCKSZ) == plan[j].crc
        at = end
    return R_OK


def read_images(fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end, int fd):
    """The pages ``keys`` have as images in one layer, or None where declined: see the twin."""
    return _read(fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end, fd,
                 None, 0, 0, None)


def read_images_into(fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end,
                     int fd, out, dest, stride, slots):
    """``read_images`` with each page read into ``out`` at ``dest + slot * stride``: see the twin."""
    return _read(fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end, fd,
                 out, dest, stride, slots)


cdef object _read(fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end,
                  int fd, object out, object dest, object stride, object slots):
    cdef list key_list = list(keys)
    cdef Py_ssize_t nkeys = len(key_list), n, i, blkno, nblk = n_blocks, last_blk = -1, n_entries
    cdef object k, block, raw, last_raw = None
    for n in range(nkeys):
        k = key_list[n]
        if not PyBytes_Check(k) or PyBytes_GET_SIZE(k) != C_KEY:
            raise ValueError("keys must be 18-byte bytes")
    cdef uint64_t c_cont = _u64("cont", cont), c_floor = _u64("floor", floor)
    cdef uint64_t c_start = _u64("data_start", data_start), c_end = _u64("data_end", data_end)
    # the pages' place in ``out`` (read_images_into), checked before anything is read
    cdef unsigned char[::1] out_view
    cdef unsigned char *outp = NULL
    cdef Py_ssize_t c_dest = 0, c_stride = 0, room, slot
    cdef list slot_list = None
    if out is not None:
        if not isinstance(out, bytearray):
            raise TypeError("out must be a bytearray")
        if stride < C_BLCKSZ or dest < 0:
            raise ValueError(f"dest {dest} and stride {stride}: pages would overlap or fall outside")
        slot_list = list(slots)
        if len(slot_list) != nkeys:
            raise ValueError(f"{nkeys} keys but {len(slot_list)} slots")
        room = len(out) - C_BLCKSZ - dest if dest <= len(out) else -1
        c_dest = dest
        c_stride = stride
        for n in range(nkeys):
            if not 0 <= slot_list[n] or room < 0 or slot_list[n] > room // c_stride:
                raise ValueError(f"slot {slot_list[n]} is outside out")
        if len(out):
            out_view = out  # (an export: the bytearray cannot be resized while it is held)
            outp = &out_view[0]
    if not isinstance(fences, list):
        fences = list(fences)
    cdef list fence_list = fences
    cdef bint exact = PyDict_CheckExact(blocks) or type(blocks) is OrderedDict
    move_to_end = getattr(blocks, "move_to_end", None)
    cdef unsigned char target[C_PREFIX]
    cdef const unsigned char *kp
    cdef const unsigned char *rawp
    cdef const unsigned char *e
    cdef PyObject *found
    cdef uint64_t lsn, pos, off, length
    cdef Py_ssize_t hits = 0, n_plan = 0, calls = 0
    cdef int64_t nbytes = 0
    cdef list pages = [None] * nkeys
    cdef list held = []  # the blocks' raw entries searched (kept alive for the search)
    cdef list planned = []  # the pages planned, in plan order (kept alive while read into)
    cdef Planned *plan = <Planned *>malloc(<size_t>(nkeys if nkeys else 1) * sizeof(Planned))
    cdef iovec *iov = <iovec *>malloc(2 * C_MAX_RUN * sizeof(iovec))
    cdef int status, err = 0
    cdef bytes absent = PyBytes_FromStringAndSize(NULL, nkeys)
    cdef unsigned char *absent_p = <unsigned char *>PyBytes_AS_STRING(absent)
    memset(absent_p, 0, <size_t>nkeys)
    if plan == NULL or iov == NULL:
        free(plan)
        free(iov)
        raise MemoryError()
    try:
        for i in range(8):
            target[C_KEY + i] = <unsigned char>((c_cont >> (56 - 8 * i)) & 0xFF)
        # 1. search, with the GIL (the block cache is a dict)
        for n in range(nkeys):
            kp = <const unsigned char *>PyBytes_AS_STRING(key_list[n])
            memcpy(target, kp, C_KEY)
            blkno = _fence_bisect_right(fence_list, target, C_PREFIX) - 1
            if blkno < 0:
                absent_p[n] = 1  # every entry is above the key's
                continue
            if blkno >= nblk:
                continue
            ident = (file_id, blkno)
            if exact:
                found = PyDict_GetItem(blocks, ident)
                block = <object>found if found != NULL else None
            else:
                block = blocks.get(ident)
            if block is None:
                continue
            if move_to_end is not None:
                move_to_end(ident)
            hits += 1
            if blkno == last_blk and block.raw is last_raw:
                raw = last_raw
            else:
                raw = block.raw
                if not PyBytes_Check(raw):
                    raise TypeError("an index block's raw entries must be bytes")
                if PyBytes_GET_SIZE(raw) != len(block.prefixes) * C_ENTRY:
                    raise ValueError("an index block's raw entries do not match its decoded entries")
                held.append(raw)
                last_blk, last_raw = blkno, raw
            rawp = <const unsigned char *>PyBytes_AS_STRING(raw)
            n_entries = PyBytes_GET_SIZE(raw) // C_ENTRY
            i = _entry_bisect_left(rawp, n_entries, target)
            if i == 0:
                if blkno == 0:
                    absent_p[n] = 1
                continue
            e = rawp + (i - 1) * C_ENTRY
            lsn = ps_be64(e + C_KEY)
            if memcmp(e, kp, C_KEY) != 0 or lsn < c_floor:
                absent_p[n] = 1
                continue
            if lsn >= c_cont:
                continue
            pos = ps_be64(e + C_PREFIX)
            length = ps_be32(e + C_PREFIX + 8)
            if not (pos & 1) or length != C_BLOB:
                continue
            off = pos >> 1
            if off < c_start or off > c_end or c_end - off < length:
                continue
            plan[n_plan].index = n
            plan[n_plan].off = off
            plan[n_plan].crc = ps_be32(e + C_PREFIX + 12)
            if outp != NULL:
                slot = slot_list[n]
                plan[n_plan].page = outp + c_dest + slot * c_stride
            else:
                page = PyBytes_FromStringAndSize(NULL, C_BLCKSZ)
                planned.append(page)
                plan[n_plan].page = <unsigned char *>PyBytes_AS_STRING(page)
            plan[n_plan].tag = 0xFF
            plan[n_plan].ok = False
            n_plan += 1
        # 2. the reads and checks, without the GIL
        with nogil:
            status = _read_all(fd, plan, n_plan, &calls, &nbytes, iov, &err)
        if status == R_OSERROR:
            raise OSError(err, os.strerror(err))
        if out is not None:
            placed = PyBytes_FromStringAndSize(NULL, nkeys)
            memset(PyBytes_AS_STRING(placed), 0, <size_t>nkeys)
            for n in range(n_plan):
                if plan[n].ok:
                    (<unsigned char *>PyBytes_AS_STRING(placed))[plan[n].index] = 1
            return placed, absent, hits, calls, nbytes, status != R_UNSUPPORTED
        for n in range(n_plan):
            if plan[n].ok:
                pages[plan[n].index] = planned[n]
        return pages, absent, hits, calls, nbytes, status != R_UNSUPPORTED
    finally:
        free(plan)
        free(iov)

