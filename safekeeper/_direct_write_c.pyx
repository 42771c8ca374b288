# The O_DIRECT staged write of a WAL segment piece, compiled: the twin of
# safekeeper/_direct_write_py.py (the reference, whose docstring has the contract). Same names,
# results and error classes (tests/safekeeper/test_direct_write_kernel.py). Arguments are
# checked and every buffer acquired with the GIL; the copies, the writes and the sync then run
# in one stretch without it.
"""O_DIRECT staged write of a WAL segment piece, compiled (see safekeeper/_direct_write_py.py)."""

from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy, memmove, memset
from libc.errno cimport errno, EINTR, ENOSPC
from cpython.buffer cimport (
    PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer,
)
from cpython.mem cimport PyMem_Free, PyMem_Malloc

import os

cdef extern from *:
    """
    #include <unistd.h>
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_direct_write_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_direct_write_source_hash
    ssize_t pwrite(int fd, const void *buf, size_t count, long long offset) nogil
    int fdatasync(int fd) nogil

IMPL = "native"
SOURCE_HASH = ps_direct_write_source_hash.decode("ascii")
ALIGN = 4096
DEF C_ALIGN = 4096

__all__ = ["ALIGN", "IMPL", "write_staged"]

# What failed, for the error raised once the GIL is back.
DEF FAIL_NONE = 0
DEF FAIL_WRITE = 1
DEF FAIL_NO_PROGRESS = 2
DEF FAIL_SYNC = 3


cdef int _pwrite_all(int fd, const unsigned char *buf, int64_t n, int64_t offset,
                     int64_t *fail_at, int *err) noexcept nogil:
    cdef ssize_t r
    while n > 0:
        r = pwrite(fd, buf, <size_t>n, offset)
        if r < 0:
            if errno == EINTR:
                continue
            err[0] = errno
            fail_at[0] = offset
            return FAIL_WRITE
        if r == 0:
            fail_at[0] = offset
            return FAIL_NO_PROGRESS
        buf += r
        n -= r
        offset += r
    return FAIL_NONE


cdef int _run(int fd, unsigned char *stage, int64_t size, int64_t head, Py_buffer *bufs,
              Py_ssize_t count, int64_t start, int sync, int64_t *kept, int64_t *fail_at,
              int *err) noexcept nogil:
    cdef Py_ssize_t index = 0
    cdef int64_t at = 0, fill = head, take, padded, tail
    cdef int rc
    kept[0] = 0
    while True:
        while fill < size and index < count:
            take = bufs[index].len - at
            if take > size - fill:
                take = size - fill
            memcpy(stage + fill, <const unsigned char *>bufs[index].buf + at, <size_t>take)
            fill += take
            at += take
            if at == bufs[index].len:
                index += 1
                at = 0
        if fill == 0:
            break
        padded = (fill + C_ALIGN - 1) // C_ALIGN * C_ALIGN
        memset(stage + fill, 0, <size_t>(padded - fill))
        rc = _pwrite_all(fd, stage, padded, start, fail_at, err)
        if rc != FAIL_NONE:
            return rc
        if index >= count:
            tail = fill % C_ALIGN
            if tail:
                memmove(stage, stage + fill - tail, <size_t>tail)
            kept[0] = tail
            break
        start += fill
        fill = 0
    if sync:
        while fdatasync(fd) != 0:
            if errno != EINTR:
                err[0] = errno
                return FAIL_SYNC
    return FAIL_NONE


def write_staged(int fd, stage, Py_ssize_t head, chunks, long long start, bint sync):
    """See safekeeper/_direct_write_py.py; returns the bytes kept at the start of ``stage``."""
    cdef Py_buffer sbuf
    cdef Py_buffer *bufs = NULL
    cdef Py_ssize_t count, i, got = 0
    cdef int64_t kept = 0, fail_at = 0
    cdef int err = 0, rc = FAIL_NONE
    try:
        PyObject_GetBuffer(stage, &sbuf, PyBUF_SIMPLE | PyBUF_WRITABLE)
    except BufferError as exc:
        raise ValueError(f"the staging buffer is read-only or not contiguous: {exc}") from None
    try:
        if sbuf.len < 2 * C_ALIGN or sbuf.len % C_ALIGN:
            raise ValueError(
                f"the staging buffer's length {sbuf.len} is not a multiple of {C_ALIGN} of at "
                "least two blocks"
            )
        if (<uintptr_t>sbuf.buf) % C_ALIGN:
            raise ValueError(f"the staging buffer is not aligned to {C_ALIGN} bytes")
        if not 0 <= head < C_ALIGN:
            raise ValueError(f"head {head} is outside [0, {C_ALIGN})")
        if start < 0 or start % C_ALIGN:
            raise ValueError(f"file offset {start} is not a non-negative multiple of {C_ALIGN}")
        count = len(chunks)
        bufs = <Py_buffer *>PyMem_Malloc((count if count else 1) * sizeof(Py_buffer))
        if bufs == NULL:
            raise MemoryError()
        for i in range(count):
            PyObject_GetBuffer(chunks[i], &bufs[i], PyBUF_SIMPLE)
            got += 1
        with nogil:
            rc = _run(fd, <unsigned char *>sbuf.buf, sbuf.len, head, bufs, count, start, sync,
                      &kept, &fail_at, &err)
    finally:
        for i in range(got):
            PyBuffer_Release(&bufs[i])
        PyMem_Free(bufs)
        PyBuffer_Release(&sbuf)
    if rc == FAIL_WRITE:
        raise OSError(err, os.strerror(err))
    if rc == FAIL_NO_PROGRESS:
        raise OSError(ENOSPC, f"pwrite wrote nothing at offset {fail_at}")
    if rc == FAIL_SYNC:
        raise OSError(err, os.strerror(err))
    return kept
