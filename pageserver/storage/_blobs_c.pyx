# The blob gather of a vectored read, compiled: the twin of pageserver/storage/_blobs_py.py
# (the reference, which documents the behaviour). Same names, results and error classes
# (tests/pageserver/test_native_blobs.py). The reads and the checks run without the GIL (a
# threadpool IO engine then runs them beside the trio thread); every offset and length is
# checked in 64-bit arithmetic before a pointer moves (native.md 6.1).
"""Blob gather of a vectored read, compiled (see pageserver/storage/_blobs_py.py)."""

from libc.stdint cimport uint32_t, int64_t
from libc.stdlib cimport free, malloc, calloc
from libc.errno cimport errno, EAGAIN, EINTR, EOPNOTSUPP, EINVAL
from cpython.bytes cimport PyBytes_FromStringAndSize

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
    static ssize_t ps_pread_nowait(int fd, void *buf, size_t n, off_t off)
    {
    #ifdef RWF_NOWAIT
        struct iovec iov = { buf, n };
        return preadv2(fd, &iov, 1, off, RWF_NOWAIT);
    #else
        errno = EOPNOTSUPP;
        return -1;
    #endif
    }
    """
    const char *ps_blobs_source_hash
    ssize_t ps_pread_nowait(int fd, void *buf, size_t n, long off) nogil
    ssize_t pread(int fd, void *buf, size_t n, long off) nogil
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


cdef struct Job:
    int fd
    int64_t offset
    int64_t total
    int64_t got
    int64_t first
    int64_t count
    unsigned char *buf


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
            got = ps_pread_nowait(jobs[i].fd, jobs[i].buf, <size_t>jobs[i].total, jobs[i].offset)
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
            got = pread(jobs[i].fd, jobs[i].buf + jobs[i].got,
                        <size_t>(jobs[i].total - jobs[i].got), jobs[i].offset + jobs[i].got)
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
            if ps_crc32c(0, jobs[i].buf + start, <size_t>blobs[s].length) != blobs[s].crc:
                bad_job[0], bad_slot[0] = i, s
                return ST_CRC
    return ST_OK


def gather_blobs(jobs, spans, blobs, probe):
    """Perform the planned reads and hand out their checked blobs: see the twin."""
    cdef Py_ssize_t n = len(jobs), nb = len(blobs), i, s
    if len(spans) != n:
        raise ValueError(f"{n} reads but {len(spans)} spans")
    cdef Job *js = <Job *>calloc(n if n else 1, sizeof(Job))
    cdef Blob *bs = <Blob *>calloc(nb if nb else 1, sizeof(Blob))
    cdef int calls = 0, err = 0, status = ST_OK
    cdef bint supported = True
    cdef bint try_nowait = bool(probe)
    cdef Py_ssize_t bad_job = 0, bad_slot = 0
    cdef int64_t expected = 0, first, count, offset, total
    cdef const unsigned char *p
    if js == NULL or bs == NULL:
        free(js)
        free(bs)
        raise MemoryError()
    try:
        for i in range(n):
            first, count = spans[i]
            if first != expected or count < 0:
                raise ValueError(f"span ({first}, {count}) does not follow slot {expected}")
            expected += count
            fd, offset, total = jobs[i]
            if total < 0 or offset < 0:
                raise ValueError(f"read {i}: offset {offset}, length {total}")
            js[i].fd, js[i].offset, js[i].total = fd, offset, total
            js[i].first, js[i].count = first, count
        if expected != nb:
            raise ValueError(f"spans cover {expected} slots of {nb}")
        for s in range(nb):
            bs[s].off, bs[s].length, bs[s].crc = blobs[s]
        for i in range(n):
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
        values = []
        kinds = bytearray(nb)
        for i in range(n):
            for s in range(js[i].first, js[i].first + js[i].count):
                p = js[i].buf + bs[s].start
                if bs[s].length and p[0] == C_TAG_IMAGE:
                    values.append(PyBytes_FromStringAndSize(<const char *>p + 1, bs[s].length - 1))
                    kinds[s] = 1
                else:
                    values.append(PyBytes_FromStringAndSize(<const char *>p, bs[s].length))
        return values, bytes(kinds), calls, supported
    finally:
        for i in range(n):
            free(js[i].buf)
        free(js)
        free(bs)
