# The blob gather of a vectored read, compiled: the twin of pageserver/storage/_blobs_py.py
# (the reference, which documents the behaviour). Same names, results and error classes
# (tests/pageserver/test_native_blobs.py). The reads and the checks run without the GIL (a
# threadpool IO engine then runs them beside the trio thread); every offset and length is
# checked in 64-bit arithmetic before a pointer moves (native.md 6.1).
"""Blob gather of a vectored read, compiled (see pageserver/storage/_blobs_py.py)."""

from libc.stdint cimport uint32_t, int64_t
from libc.stdlib cimport free, malloc, calloc
from libc.string cimport memcpy
from libc.errno cimport errno, EAGAIN, EINTR, EOPNOTSUPP, EINVAL
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

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
    static const char *ps_blobs_source_hash = PAGESTORE_SOURCE_HASH;
    /* Read bytes [at, total) of a read at file offset ``offset``. Its bytes are ``head``
       (all of them), or, for a read split in two, ``head``'s one byte (a blob's tag) then
       ``tail`` (the rest: the page of an image, read straight into the bytes handed out). */
    static ssize_t ps_read_part(int fd, unsigned char *head, unsigned char *tail,
                                int64_t total, int64_t at, int64_t offset, int nowait)
    {
        struct iovec iov[2];
        int n = 1;
        if (tail == NULL) {
            iov[0].iov_base = head + at;
            iov[0].iov_len = (size_t)(total - at);
        } else if (at == 0) {
            iov[0].iov_base = head;
            iov[0].iov_len = 1;
            iov[1].iov_base = tail;
            iov[1].iov_len = (size_t)(total - 1);
            n = 2;
        } else {
            iov[0].iov_base = tail + (at - 1);
            iov[0].iov_len = (size_t)(total - at);
        }
        if (nowait) {
    #ifdef RWF_NOWAIT
            return preadv2(fd, iov, n, (off_t)(offset + at), RWF_NOWAIT);
    #else
            errno = EOPNOTSUPP;
            return -1;
    #endif
        }
        return preadv(fd, iov, n, (off_t)(offset + at));
    }
    """
    const char *ps_blobs_source_hash
    ssize_t ps_read_part(int fd, unsigned char *head, unsigned char *tail, int64_t total,
                         int64_t at, int64_t offset, int nowait) nogil
    int posix_fadvise(int fd, long off, long n, int advice) nogil
    int POSIX_FADV_WILLNEED

import os

__all__ = ["IMPL", "BlobChecksumError", "BlobOutsideRead", "ShortRead", "gather_blobs"]

IMPL = "native"
SOURCE_HASH = ps_blobs_source_hash.decode("ascii")
TAG_IMAGE = 0

ps_crc32c_choose(1 if os.environ.get("PAGESTORE_CRC32C_SW") == "1" else 0)

cdef enum:
    C_TAG_IMAGE = 0
    ST_OK = 0
    ST_SHORT = 1
    ST_OUTSIDE = 2
    ST_CRC = 3
    ST_OSERROR = 4


class ShortRead(ValueError):
    """The file ended inside a planned read: ``(read index, bytes got, bytes wanted)``."""


class BlobOutsideRead(ValueError):
    """An index entry's blob does not lie inside the read planned for it."""


class BlobChecksumError(ValueError):
    """A blob's bytes do not have its index entry's CRC-32C: ``(read index, slot)``."""


# A read of one blob at least this long that is exactly its read is split (see ps_read_part):
# an image's page is read straight into the bytes object handed out, with no buffer to
# allocate and no copy of the page.
DEF SPLIT_MIN = 4096


cdef struct Job:
    int fd
    int64_t offset
    int64_t total
    int64_t got
    int64_t first
    int64_t count
    unsigned char *buf   # the read's bytes; for a split read, its first byte only (``head``)
    unsigned char *tail  # a split read's other bytes (a bytes object's buffer), else NULL
    unsigned char head[8]


cdef struct Blob:
    int64_t off
    int64_t length
    uint32_t crc
    int64_t start   # inside its read's buffer, set by the check


cdef int _read_all(Job *jobs, Py_ssize_t n, bint probe, int *calls, bint *supported,
                   int *err) noexcept nogil:
    cdef Py_ssize_t i, k
    cdef ssize_t got
    cdef int64_t more
    for i in range(n):
        jobs[i].got = 0
        if probe:
            calls[0] += 1
            got = ps_read_part(jobs[i].fd, jobs[i].buf, jobs[i].tail, jobs[i].total, 0,
                               jobs[i].offset, 1)
            if got < 0:
                if errno == EAGAIN:
                    got = 0
                elif errno == EOPNOTSUPP or errno == EINVAL:
                    got = 0
                    probe = False
                    supported[0] = False
                else:
                    err[0] = errno
                    return ST_OSERROR
            jobs[i].got = got
            if got < jobs[i].total and probe:
                probe = False
                if i + 1 < n:
                    for k in range(i, n):
                        posix_fadvise(jobs[k].fd, jobs[k].offset, jobs[k].total, POSIX_FADV_WILLNEED)
        while jobs[i].got < jobs[i].total:
            calls[0] += 1
            got = ps_read_part(jobs[i].fd, jobs[i].buf, jobs[i].tail, jobs[i].total,
                               jobs[i].got, jobs[i].offset, 0)
            if got < 0:
                if errno == EINTR:
                    continue
                err[0] = errno
                return ST_OSERROR
            if got == 0:
                break
            jobs[i].got += got
    return ST_OK


cdef int _check(Job *jobs, Py_ssize_t n, Blob *blobs, Py_ssize_t *bad_job,
                Py_ssize_t *bad_slot) noexcept nogil:
    cdef Py_ssize_t i, s
    cdef int64_t start
    cdef uint32_t crc
    for i in range(n):
        if jobs[i].got != jobs[i].total:
            bad_job[0] = i
            return ST_SHORT
        for s in range(jobs[i].first, jobs[i].first + jobs[i].count):
            start = blobs[s].off - jobs[i].offset
            if start < 0 or blobs[s].length < 0 or start > jobs[i].total - blobs[s].length:
                bad_job[0], bad_slot[0] = i, s
                return ST_OUTSIDE
            blobs[s].start = start
            if jobs[i].tail != NULL:  # (its one blob is the whole read: start 0)
                crc = ps_crc32c(ps_crc32c(0, jobs[i].buf, 1), jobs[i].tail, <size_t>(blobs[s].length - 1))
            else:
                crc = ps_crc32c(0, jobs[i].buf + start, <size_t>blobs[s].length)
            if crc != blobs[s].crc:
                bad_job[0], bad_slot[0] = i, s
                return ST_CRC
    return ST_OK


def gather_blobs(reads, blobs, fd_of, probe):
    """Perform the planned reads and hand out their checked blobs: see the twin."""
    cdef Py_ssize_t n = len(reads), nb = len(blobs), i, s
    cdef Job *js = <Job *>calloc(n if n else 1, sizeof(Job))
    cdef Blob *bs = <Blob *>calloc(nb if nb else 1, sizeof(Blob))
    cdef int calls = 0, err = 0, status = ST_OK
    cdef bint supported = True
    cdef bint try_nowait = bool(probe)
    cdef Py_ssize_t bad_job = 0, bad_slot = 0
    cdef int64_t expected = 0, first, count, offset, total, nbytes = 0
    cdef int fd = -1
    cdef const unsigned char *p
    cdef unsigned char *q
    cdef list tails = [None] * n
    cdef object last = None, reader
    cdef bint have_fd = False
    if js == NULL or bs == NULL:
        free(js)
        free(bs)
        raise MemoryError()
    try:
        for i in range(n):
            reader, offset, total, first, count = reads[i]
            if first != expected or count < 0:
                raise ValueError(f"span ({first}, {count}) does not follow slot {expected}")
            expected += count
            if total < 0 or offset < 0:
                raise ValueError(f"read {i}: offset {offset}, length {total}")
            if not have_fd or reader is not last:
                # one lookup per run of reads of one reader (a batch reads few layers)
                fd = fd_of(reader)
                last, have_fd = reader, True
            js[i].fd, js[i].offset, js[i].total = fd, offset, total
            js[i].first, js[i].count = first, count
        if expected != nb:
            raise ValueError(f"spans cover {expected} slots of {nb}")
        for s in range(nb):
            bs[s].off, bs[s].length, bs[s].crc = blobs[s]
        for i in range(n):
            if (js[i].count == 1 and js[i].total >= SPLIT_MIN and bs[js[i].first].off == js[i].offset
                    and bs[js[i].first].length == js[i].total):
                tail = PyBytes_FromStringAndSize(NULL, js[i].total - 1)
                tails[i] = tail  # (held: filled, then handed out, before anyone else sees it)
                js[i].tail = <unsigned char *>PyBytes_AS_STRING(tail)
                js[i].buf = js[i].head
                continue
            js[i].buf = <unsigned char *>malloc(<size_t>js[i].total if js[i].total else 1)
            if js[i].buf == NULL:
                raise MemoryError()
        with nogil:
            status = _read_all(js, n, try_nowait, &calls, &supported, &err)
            if status == ST_OK:
                status = _check(js, n, bs, &bad_job, &bad_slot)
        if status == ST_OSERROR:
            raise OSError(err, os.strerror(err))
        if status == ST_SHORT:
            raise ShortRead(bad_job, js[bad_job].got, js[bad_job].total)
        if status == ST_OUTSIDE:
            raise BlobOutsideRead(bad_job, bad_slot)
        if status == ST_CRC:
            raise BlobChecksumError(bad_job, bad_slot)
        for i in range(n):
            nbytes += js[i].total  # (each was read whole: no overflow)
        values = []
        kinds = bytearray(nb)
        for i in range(n):
            if js[i].tail != NULL:
                s = js[i].first
                tail = tails[i]
                if js[i].head[0] == C_TAG_IMAGE:
                    values.append(tail)  # the page, read in place
                    kinds[s] = 1
                else:
                    whole = PyBytes_FromStringAndSize(NULL, bs[s].length)
                    q = <unsigned char *>PyBytes_AS_STRING(whole)
                    q[0] = js[i].head[0]
                    memcpy(q + 1, js[i].tail, <size_t>(bs[s].length - 1))
                    values.append(whole)
                continue
            for s in range(js[i].first, js[i].first + js[i].count):
                p = js[i].buf + bs[s].start
                if bs[s].length and p[0] == C_TAG_IMAGE:
                    values.append(PyBytes_FromStringAndSize(<const char *>p + 1, bs[s].length - 1))
                    kinds[s] = 1
                else:
                    values.append(PyBytes_FromStringAndSize(<const char *>p, bs[s].length))
        return values, bytes(kinds), calls, supported, nbytes
    finally:
        for i in range(n):
            if js[i].tail == NULL:
                free(js[i].buf)
        free(js)
        free(bs)
