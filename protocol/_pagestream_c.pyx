# Pagestream batch codec, compiled: the twin of protocol/_pagestream_py.py (the reference,
# which documents the behaviour). Same names, results and error classes
# (tests/protocol/test_native_pagestream.py). Every length is checked against the bytes that
# remain before it is used (native.md 6.1); a batch's responses are sized once and copied in
# with memcpy.
"""Pagestream batch codec, compiled (see protocol/_pagestream_py.py for the reference)."""

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize

cdef extern from "_bytes.h":
    uint32_t ps_be32(const unsigned char *p) nogil
    uint64_t ps_be64(const unsigned char *p) nogil
    void ps_put_be32(unsigned char *p, uint32_t v) nogil
    void ps_put_be64(unsigned char *p, uint64_t v) nogil

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_pagestream_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_pagestream_source_hash

__all__ = ["IMPL", "MAX_CACHED_RELS", "decode_getpages", "encode_getpage_responses"]

IMPL = "native"
SOURCE_HASH = ps_pagestream_source_hash.decode("ascii")
BLCKSZ = 8192
MAX_CACHED_RELS = 1024

cdef enum:
    C_BLCKSZ = 8192
    V3_SIZE = 47          # 'd', u32, tag, reqid, lsn, nms, spc, db, rel, fork, blkno
    V2_SIZE = 39
    RESP_V3_HEAD = 47     # 'd', u32, tag 102, reqid, lsn, nms, spc, db, rel, fork, blkno
    RESP_V2_HEAD = 6
    TAG_GET_PAGE_REQUEST = 2
    TAG_GET_PAGE_RESPONSE = 102


def decode_getpages(buf, pos, end, v3, limit, make_request, make_rel, rels):
    """Every framed GetPage at ``buf[pos:end]`` at once; see the twin."""
    cdef const unsigned char[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t size_all = view.shape[0]
    if not 0 <= pos <= end <= size_all:
        raise ValueError(f"range [{pos}, {end}) is not inside {size_all} bytes")
    if limit < 0:
        raise ValueError(f"limit {limit} is negative")
    cdef bint is_v3 = bool(v3)
    cdef Py_ssize_t p = pos, e = end, size = V3_SIZE if is_v3 else V2_SIZE
    cdef Py_ssize_t most = limit if limit < (1 << 40) else (1 << 40)
    cdef Py_ssize_t count = 0
    cdef const unsigned char *b = &view[0] if size_all else NULL
    cdef const unsigned char *m
    cdef uint64_t reqid, lsn, nms
    cdef uint32_t spc, db, relnode, blk
    cdef unsigned char fork
    cdef Py_ssize_t body
    out = []
    while count < most and e - p >= size:
        m = b + p
        if m[0] != 0x64 or m[5] != TAG_GET_PAGE_REQUEST or ps_be32(m + 1) != <uint32_t>(size - 1):
            break
        if is_v3:
            reqid = ps_be64(m + 6)
            body = 14
        else:
            reqid = 0
            body = 6
        lsn = ps_be64(m + body)
        nms = ps_be64(m + body + 8)
        spc = ps_be32(m + body + 16)
        db = ps_be32(m + body + 20)
        relnode = ps_be32(m + body + 24)
        fork = m[body + 28]
        blk = ps_be32(m + body + 29)
        p += size
        key = (spc, db, relnode, fork)
        rel = rels.get(key)
        if rel is None:
            if len(rels) >= MAX_CACHED_RELS:
                rels.clear()
            rel = make_rel(spc, db, relnode, fork)
            rels[key] = rel
        out.append(make_request(reqid, lsn, nms, rel, blk))
        count += 1
    return out, p


def encode_getpage_responses(out, v3, requests, pages):
    """Append one framed GetPage response per (request, page) to ``out``; see the twin."""
    cdef Py_ssize_t n = len(requests), i
    if len(pages) != n:
        raise ValueError(f"{n} requests but {len(pages)} pages")
    cdef Py_buffer view
    for i in range(n):
        PyObject_GetBuffer(pages[i], &view, PyBUF_SIMPLE)
        try:
            if view.len != C_BLCKSZ:
                raise ValueError(f"a page is {BLCKSZ} bytes, got {view.len}")
        finally:
            PyBuffer_Release(&view)
    if not isinstance(out, bytearray):
        raise TypeError("out must be a bytearray")
    cdef bint is_v3 = bool(v3)
    cdef Py_ssize_t head = RESP_V3_HEAD if is_v3 else RESP_V2_HEAD
    cdef Py_ssize_t at = PyByteArray_GET_SIZE(out)
    cdef Py_ssize_t grow = n * (head + C_BLCKSZ)
    # the values first (what can fail), then one resize and the copies
    cdef list vals = []
    if is_v3:
        for req in requests:
            r = req.rel
            vals.append((req.reqid, req.request_lsn, req.not_modified_since, r.spcnode,
                         r.dbnode, r.relnode, r.forknum, req.blkno))
    PyByteArray_Resize(out, at + grow)
    cdef unsigned char *d = <unsigned char *>PyByteArray_AS_STRING(out) + at
    cdef uint64_t reqid, lsn, nms
    cdef uint32_t spc, db, relnode, blk
    cdef unsigned char fork
    try:
        for i in range(n):
            d[0] = 0x64
            ps_put_be32(d + 1, <uint32_t>(head - 1 + C_BLCKSZ))
            d[5] = TAG_GET_PAGE_RESPONSE
            if is_v3:
                reqid, lsn, nms, spc, db, relnode, fork, blk = vals[i]
                ps_put_be64(d + 6, reqid)
                ps_put_be64(d + 14, lsn)
                ps_put_be64(d + 22, nms)
                ps_put_be32(d + 30, spc)
                ps_put_be32(d + 34, db)
                ps_put_be32(d + 38, relnode)
                d[42] = fork
                ps_put_be32(d + 43, blk)
            PyObject_GetBuffer(pages[i], &view, PyBUF_SIMPLE)
            memcpy(d + head, view.buf, C_BLCKSZ)
            PyBuffer_Release(&view)
            d += head + C_BLCKSZ
    except BaseException:
        PyByteArray_Resize(out, at)  # nothing appended, as on every other error
        raise
