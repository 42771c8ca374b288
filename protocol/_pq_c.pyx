# Wire-message kernels in Cython: the compiled twin of protocol/_pq_py.py (the reference).
#
# Same names, signatures, results and error classes as the twin (tests/protocol/
# test_native_pq.py). Every length from the wire is checked against the bytes that remain, in
# 64-bit arithmetic, before it is used (native.md 6.1).
"""Wire-message kernels, compiled (see protocol/_pq_py.py for the reference and the docs)."""

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_Append
from cpython.sequence cimport PySequence_GetSlice

cdef extern from "_bytes.h":
    uint32_t ps_be32(const unsigned char *p) nogil
    uint64_t ps_be64(const unsigned char *p) nogil

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_pq_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_pq_source_hash

__all__ = ["IMPL", "coalesce_appends", "take_append_run", "take_frames"]

IMPL = "native"
SOURCE_HASH = ps_pq_source_hash.decode("ascii")

cdef enum:
    TAG_APPEND = 0x61
    V3_HEADER = 45
    MAX_SEND_SIZE = 16 * 8192

_NOTHING = (0, 0, 0, 0, 0, 0, 0, b"")


cdef inline bint _header(const unsigned char *p, Py_ssize_t n, uint32_t *gen, uint64_t *term,
                         uint64_t *begin, uint64_t *end, uint64_t *commit, uint64_t *trunc) noexcept nogil:
    # The fast path's conditions, exactly: long enough, tag 'a', begin <= end, at most
    # MAX_SEND_SIZE of WAL, and the WAL all there.
    if n < V3_HEADER or p[0] != TAG_APPEND:
        return False
    gen[0] = ps_be32(p + 1)
    term[0] = ps_be64(p + 5)
    begin[0] = ps_be64(p + 13)
    end[0] = ps_be64(p + 21)
    commit[0] = ps_be64(p + 29)
    trunc[0] = ps_be64(p + 37)
    if end[0] < begin[0] or end[0] - begin[0] > MAX_SEND_SIZE:
        return False
    return <uint64_t>(n - V3_HEADER) >= end[0] - begin[0]


def coalesce_appends(payloads, k, max_bytes):
    """Coalesce a run of continuing v3 AppendRequests from ``payloads[k]``; see the twin."""
    cdef Py_ssize_t count_all = len(payloads)
    if not 0 <= k <= count_all:
        raise IndexError(f"start {k} outside {count_all} payloads")
    if max_bytes < 0:
        raise ValueError(f"max_bytes {max_bytes} is negative")
    cdef uint64_t limit = max_bytes if max_bytes < (1 << 62) else (1 << 62)
    cdef Py_ssize_t j, first_index = k
    cdef Py_ssize_t taken = 0
    cdef uint64_t total = 0, size
    cdef uint32_t gen = 0, generation = 0
    cdef uint64_t term = 0, run_term = 0, begin = 0, end = 0, c = 0, tr = 0
    cdef uint64_t first = 0, last_end = 0, commit = 0, trunc = 0
    cdef Py_buffer view
    cdef bint ok
    # Pass 1: how long the run is (each payload's buffer held only while it is read).
    for j in range(first_index, count_all):
        obj = payloads[j]
        _as_bytes_buffer(obj, &view)
        try:
            ok = _header(<const unsigned char *>view.buf, view.len, &gen, &term, &begin, &end, &c, &tr)
        finally:
            PyBuffer_Release(&view)
        if not ok:
            break
        size = end - begin
        if taken:
            if gen != generation or term != run_term or begin != last_end or total + size > limit:
                break
            if c > commit:
                commit = c
            if tr > trunc:
                trunc = tr
        else:
            generation, run_term, first, commit, trunc = gen, term, begin, c, tr
        total += size
        last_end = end
        taken += 1
    if taken < 2:
        return _NOTHING
    # Pass 2: one copy of the run's WAL into one bytes object.
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
    cdef char *dst = PyBytes_AS_STRING(out)
    cdef uint64_t at = 0
    for j in range(first_index, first_index + taken):
        _as_bytes_buffer(payloads[j], &view)
        try:
            _header(<const unsigned char *>view.buf, view.len, &gen, &term, &begin, &end, &c, &tr)
            size = end - begin
            memcpy(dst + at, <const char *>view.buf + V3_HEADER, <size_t>size)
            at += size
        finally:
            PyBuffer_Release(&view)
    return taken, run_term, generation, first, last_end, commit, trunc, out


cdef int _as_bytes_buffer(object obj, Py_buffer *view) except -1:
    # As the twin's memoryview(x).cast("B"): any C-contiguous buffer, else TypeError (which
    # is what the cast raises for a strided view; PyBUF_SIMPLE would say BufferError).
    try:
        PyObject_GetBuffer(obj, view, PyBUF_SIMPLE)
    except BufferError as exc:
        raise TypeError(f"not a C-contiguous buffer: {exc}") from None
    return 0


def take_frames(data, start, end, tag, max_length, limit):
    """Zero-copy framing of the complete ``tag`` messages in ``data[start:end]``; see the twin."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef Py_ssize_t size = view.shape[0]
    if not 0 <= start <= end <= size:
        raise ValueError(f"frame range [{start}, {end}) is not inside {size} bytes")
    if not 0 <= tag <= 255 or max_length < 0 or limit < 0:
        raise ValueError(f"bad tag {tag}, max_length {max_length} or limit {limit}")
    cdef Py_ssize_t s = start, e = end
    cdef uint64_t cap = max_length if max_length < (1 << 40) else (1 << 40)
    cdef Py_ssize_t count = 0, most = limit if limit < (1 << 40) else (1 << 40)
    cdef unsigned char want = <unsigned char>tag
    cdef uint64_t length
    cdef const unsigned char *p = &view[0] if size else NULL
    out = []
    base = None
    while e - s >= 5 and count < most:
        length = ps_be32(p + s + 1)
        # remaining-count form: no s + 1 + length computed before it is known to fit
        if p[s] != want or length < 4 or length > cap or length > <uint64_t>(e - s - 1):
            break
        if base is None:
            # one export for the batch, as the twin: its slices share it
            base = memoryview(data).cast("B")
        PyList_Append(out, PySequence_GetSlice(base, s + 5, s + 1 + <Py_ssize_t>length))
        s += 1 + <Py_ssize_t>length
        count += 1
    return out, s


# -- take_append_run: framing + AppendRequest decoding + coalescing in one pass -------------

cdef enum:
    TAG_COPY_DATA = 0x64
    # From this many input bytes the loop runs without the GIL (below it the release and
    # re-acquisition would cost more than the copy).
    NOGIL_FROM = 65536

cdef struct _Run:
    Py_ssize_t pos
    Py_ssize_t count
    uint32_t generation
    uint64_t term, first, last_end, commit, trunc


cdef void _append_run(const unsigned char *p, Py_ssize_t pos, Py_ssize_t e, uint64_t lmax,
                      unsigned char *d, uint64_t cap, _Run *run) noexcept nogil:
    # Every length is compared with what remains (e - pos, a non-negative Py_ssize_t),
    # widened to 64 bits, before any pointer moves past it (native.md 6.1).
    cdef uint64_t length, total = 0, n
    cdef uint32_t gen = 0
    cdef uint64_t term = 0, begin = 0, stop = 0, c = 0, tr = 0
    cdef const unsigned char *body
    run.count = 0
    while e - pos >= 5:
        if p[pos] != TAG_COPY_DATA:
            break
        length = ps_be32(p + pos + 1)
        if length < 4 or length > lmax or length > <uint64_t>(e - pos - 1):
            break
        body = p + pos + 5
        if not _header(body, <Py_ssize_t>(length - 4), &gen, &term, &begin, &stop, &c, &tr):
            break
        n = stop - begin
        if run.count:
            if gen != run.generation or term != run.term or begin != run.last_end or n > cap - total:
                break
            if c > run.commit:
                run.commit = c
            if tr > run.trunc:
                run.trunc = tr
        else:
            if n > cap:
                break
            run.generation, run.term, run.first, run.commit, run.trunc = gen, term, begin, c, tr
        if n:
            memcpy(d + total, body + V3_HEADER, <size_t>n)
        total += n
        run.last_end = stop
        run.count += 1
        pos += 1 + <Py_ssize_t>length
    run.pos = pos


def take_append_run(data, start, end, max_length, out, max_bytes):
    """Frame, decode and coalesce a run of v3 AppendRequests straight from received bytes,
    copying their WAL into ``out``; see the twin."""
    cdef const unsigned char[::1] src = memoryview(data).cast("B")
    cdef Py_ssize_t size = src.shape[0]
    if not 0 <= start <= end <= size:
        raise ValueError(f"frame range [{start}, {end}) is not inside {size} bytes")
    if max_length < 0 or max_bytes < 0:
        raise ValueError(f"bad max_length {max_length} or max_bytes {max_bytes}")
    out_view = memoryview(out).cast("B")
    if out_view.readonly:
        raise TypeError("take_append_run needs a writable output buffer")
    cdef unsigned char[::1] dst = out_view
    cdef Py_ssize_t s = start, e = end
    cdef uint64_t lmax = max_length if max_length < (1 << 40) else (1 << 40)
    cdef uint64_t cap = max_bytes if max_bytes < (1 << 40) else (1 << 40)
    if cap > <uint64_t>dst.shape[0]:
        cap = <uint64_t>dst.shape[0]
    cdef const unsigned char *p = &src[0] if size else NULL
    cdef unsigned char *d = &dst[0] if dst.shape[0] else NULL
    cdef _Run run
    if e - s >= NOGIL_FROM:
        # src and dst hold their exports: neither buffer can be resized meanwhile
        with nogil:
            _append_run(p, s, e, lmax, d, cap, &run)
    else:
        _append_run(p, s, e, lmax, d, cap, &run)
    if not run.count:
        return (start, 0, 0, 0, 0, 0, 0, 0)
    return (run.pos, run.count, run.term, run.generation, run.first, run.last_end, run.commit,
            run.trunc)
